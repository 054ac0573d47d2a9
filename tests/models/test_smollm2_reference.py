"""SmolLM2-135M (the bundled GGUF) against transformers loading the same file, both float32."""
from __future__ import annotations

import argparse
import os

import pytest
import torch

from slipstream import LLM, SamplingParams

pytestmark = pytest.mark.slow

MAX_NEW = 32
LOGPROB_TOL = 2e-3  # 30 layers in float32 through different kernels; observed max |diff| is below 1e-4


def _prompts(tokenizer) -> list[list[int]]:
    chats = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain what a hash table is in two sentences."]
    chat_ids = [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False) for c in chats]
    raw = ["Hello", "The quick brown fox", "def fibonacci(n):\n    ",
           "Once upon a time, in a small village by the river,"]
    raw_ids = [tokenizer(r).input_ids for r in raw]
    long_ids = tokenizer(argparse.__doc__ * 4).input_ids[:600]  # real English text, ~600 tokens
    return [list(p) for p in chat_ids] + raw_ids + [long_ids]


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    import transformers

    folder, name = os.path.dirname(smollm2_gguf), os.path.basename(smollm2_gguf)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return tokenizer, model


def test_greedy_tokens_and_prompt_logprobs_match_transformers(reference):
    tokenizer, model = reference
    prompts = _prompts(tokenizer)
    assert len(prompts) >= 8 and max(map(len, prompts)) >= 590
    llm = LLM("smollm2-135m", dtype="float32", max_num_batched_tokens=256)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)  # all prompts in ONE call
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs):
            ids = torch.tensor([prompt])
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            assert out.outputs[0].token_ids == ref, tokenizer.decode(prompt)[-60:]
            if len(prompt) < 2:
                continue
            logits = model(ids).logits[0, :-1].float().log_softmax(-1)
            ref_lp = logits.gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)
            ours = torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
            assert (ours - ref_lp).abs().max() < LOGPROB_TOL
    assert llm.stats()["num_used_blocks"] == 0
