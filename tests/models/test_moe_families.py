"""MoE families against transformers on tiny random checkpoints (float32): Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, Gemma 4 (MoE; dense with per-layer inputs and KV sharing; the multimodal
checkpoint layout), each in one batched run and one chunked-prefill run.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from slipstream import LLM, SamplingParams
from slipstream.loader.hf_config import read_hf_config
from slipstream.models.registry import build_model, config_from_hf
from tests.conftest import TINY_VOCAB, build_tiny_checkpoint, hf_greedy, hf_prompt_logprobs, random_prompts

LOGPROB_TOL = 2e-4  # float32 vs float32, different kernels: observed max |diff| ~ 4e-6
MAX_TOKENS = 10
COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
GEMMA4 = dict(COMMON, intermediate_size=96, num_hidden_layers=4, head_dim=16, global_head_dim=32, pad_token_id=0,
              sliding_window=8, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
              layer_types=["sliding_attention", "full_attention"] * 2)
GEMMA4_MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                  attention_k_eq_v=True, num_global_key_value_heads=1)

# name -> (transformers config class, kwargs, top-k per MoE layer or 0 for a dense model)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2), 2),
    "qwen2_moe": ("Qwen2MoeConfig", dict(COMMON, intermediate_size=48, moe_intermediate_size=32, num_experts=4,
                                         num_experts_per_tok=2, shared_expert_intermediate_size=40), 2),
    "qwen3_moe": ("Qwen3MoeConfig", dict(COMMON, num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=32,
                                         num_experts=4, num_experts_per_tok=3, norm_topk_prob=True, head_dim=16,
                                         mlp_only_layers=[1]), 3),
    "olmoe": ("OlmoeConfig", dict(COMMON, intermediate_size=32, num_experts=4, num_experts_per_tok=2, clip_qkv=4.0), 2),
    "gemma4_moe": ("Gemma4TextConfig", dict(GEMMA4, **GEMMA4_MOE), 2),
    # layers 4 and 5 read the K/V of layers 2 and 3 (the last earlier layer of their type)
    "gemma4_ple_kv_sharing": ("Gemma4TextConfig", dict(GEMMA4, num_hidden_layers=6, hidden_size_per_layer_input=16,
                                                       layer_types=["sliding_attention", "full_attention"] * 3,
                                                       vocab_size_per_layer_input=TINY_VOCAB, num_kv_shared_layers=2,
                                                       use_double_wide_mlp=True), 0),
}


def build_moe_checkpoint(path: str, name: str) -> str:
    import transformers

    config_class, kwargs, _ = FAMILIES[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**kwargs),
                                                          dtype=torch.float32)
    perturb_unit_parameters(model)
    model.save_pretrained(path)
    return path


def perturb_unit_parameters(model: torch.nn.Module) -> None:
    """transformers starts norms and scales at 1, which would hide a misplaced or missing one."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if any(part in name for part in ("norm", "scale", "layer_scalar")) and tensor.is_floating_point():
                tensor.copy_(1 + 0.3 * torch.randn(tensor.shape, generator=g))


def check_against_transformers(path: str, top_k: int, num_layers: int, moe_layers: list[int]) -> None:
    prompts = random_prompts(4, 3, 45, seed=1)
    expected = hf_greedy(path, prompts, max_new_tokens=MAX_TOKENS)
    references = [hf_prompt_logprobs(path, p) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0)
    for budget in (1024, 16):  # all prompts in one batched step; prefill split into 16-token chunks
        llm = LLM(path, dtype="float32", max_num_batched_tokens=budget)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected, f"max_num_batched_tokens={budget}"
        for out, ref in zip(outputs, references):
            ours = torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
            assert torch.allclose(ours, ref, atol=LOGPROB_TOL, rtol=0), (budget, (ours - ref).abs().max())
        stats = llm.stats()
        assert stats["num_used_blocks"] == 0
        tokens_run = sum(len(p) for p in prompts) + len(prompts) * (MAX_TOKENS - 1)
        assert sorted(stats.get("expert_load", {})) == moe_layers  # no entry for a model without experts
        for counts in stats.get("expert_load", {}).values():
            assert sum(counts) == tokens_run * top_k


@pytest.mark.parametrize("name", list(FAMILIES))
def test_matches_transformers(tmp_path, name):
    path = build_moe_checkpoint(str(tmp_path), name)
    config = config_from_hf(read_hf_config(path))
    top_k = FAMILIES[name][2]
    moe_layers = [i for i in range(config.num_hidden_layers) if top_k and i not in getattr(config, "dense_layers", [])]
    check_against_transformers(path, top_k, config.num_hidden_layers, moe_layers)


def test_gemma4_multimodal_checkpoint_loads_text_model(tmp_path):
    """Released Gemma 4 checkpoints are Gemma4ForConditionalGeneration: text weights under
    model.language_model, plus a vision tower we skip."""
    import transformers

    text = dict(GEMMA4, **GEMMA4_MOE)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    model = transformers.Gemma4ForConditionalGeneration(config).float()
    perturb_unit_parameters(model)
    model.save_pretrained(str(tmp_path))
    check_against_transformers(str(tmp_path), 2, 4, [0, 1, 2, 3])


def test_mixtral_loads_stacked_expert_checkpoints(tmp_path):
    """transformers 5 keeps experts stacked (mlp.experts.gate_up_proj); such files load the same."""
    per_expert = build_moe_checkpoint(str(tmp_path / "per_expert"), "mixtral")
    tensors = load_file(f"{per_expert}/model.safetensors")
    stacked = {}
    for layer in range(2):
        prefix = f"model.layers.{layer}.block_sparse_moe"
        experts = [{w: tensors.pop(f"{prefix}.experts.{e}.{w}.weight") for w in ("w1", "w2", "w3")} for e in range(4)]
        stacked[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([x["w1"], x["w3"]]) for x in experts])
        stacked[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([x["w2"] for x in experts])
        stacked[f"model.layers.{layer}.mlp.gate.weight"] = tensors.pop(f"{prefix}.gate.weight")
    config = config_from_hf(read_hf_config(per_expert))
    a, b = build_model(config), build_model(config)
    a.load_weights(load_file(f"{per_expert}/model.safetensors").items())
    b.load_weights({**tensors, **stacked}.items())
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name


def test_dense_model_reports_no_expert_load(tmp_path):
    llm = LLM(build_tiny_checkpoint(str(tmp_path), "llama"), dtype="float32")
    assert "expert_load" not in llm.stats()
