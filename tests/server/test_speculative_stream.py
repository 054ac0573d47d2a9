"""The server with --speculative-config: the same stream as without, and its counters on /metrics."""
from __future__ import annotations

import json

from fastapi.testclient import TestClient

from slipstream.config import EngineConfig
from slipstream.engine.engine import LLMEngine
from slipstream.server.app import build_app
from slipstream.speculative import speculator
from tests.server.conftest import metric
from tests.speculative.test_speculative_engine import FREE

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
BODY = {"prompt": [5, 6, 7, 5, 6, 7, 5, 6, 7, 5], "max_tokens": 40, "temperature": 0, "ignore_eos": True,
        "stream": True}


def _stream(client: TestClient) -> list[str]:
    with client.stream("POST", "/v1/completions", json=BODY) as response:
        assert response.status_code == 200
        return [line for line in response.iter_lines() if line.startswith("data: ") and '"id"' in line]


def _tokens(lines: list[str]) -> list[dict]:
    return [json.loads(line[6:])["choices"][0] for line in lines]


def test_streamed_output_equals_the_non_speculative_stream(tiny_chat_model, monkeypatch):
    monkeypatch.setattr(speculator, "VERIFY_COST", FREE)
    engines = [LLMEngine(EngineConfig.from_kwargs(model=tiny_chat_model, dtype="float32", speculative_config=spec))
               for spec in (None, NGRAM)]
    with TestClient(build_app(engines[0], "plain")) as plain, TestClient(build_app(engines[1], "spec")) as spec:
        expected = [(c["text"], c["finish_reason"]) for c in _tokens(_stream(plain))]
        got = [(c["text"], c["finish_reason"]) for c in _tokens(_stream(spec))]
        text = spec.get("/metrics").text
        assert "spec_decode" not in plain.get("/metrics").text
    assert "".join(t for t, _ in got) == "".join(t for t, _ in expected) and got[-1][1] == expected[-1][1] == "length"
    assert len("".join(t for t, _ in got)) > 40
    drafts = metric(text, "slipstream:spec_decode_num_draft_tokens_total", model_name="spec")
    accepted = metric(text, "slipstream:spec_decode_num_accepted_tokens_total", model_name="spec")
    assert metric(text, "slipstream:spec_decode_num_drafts_total", model_name="spec") > 0 and drafts > accepted > 0
    assert "# TYPE slipstream:spec_decode_num_accepted_tokens_total counter" in text
