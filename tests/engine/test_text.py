"""Text on the real SmolLM2 tokenizer: incremental detokenization, stop strings, chat."""
from __future__ import annotations

import pytest

from slipstream import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m", dtype="float32")


def _text(llm, **kwargs):
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, **kwargs), use_tqdm=False)[0].outputs[0]


def test_incremental_text_equals_full_decode(llm):
    out = _text(llm, ignore_eos=True)
    assert out.text == llm.get_tokenizer().decode(out.token_ids, skip_special_tokens=True)


def test_stop_string_is_cut_from_the_text(llm):
    full = _text(llm).text
    stop = full[len(full) // 3: len(full) // 3 + 4]
    cut = _text(llm, stop=[stop])
    assert cut.text == full[:full.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = _text(llm, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == full[:full.index(stop) + len(stop)]


def test_chat_answers_and_stops_at_end_of_turn(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
    m = out.metrics
    assert 0 <= m.queue_time <= m.ttft <= m.e2e_latency and m.tpot > 0
