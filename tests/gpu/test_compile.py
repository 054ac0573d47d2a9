"""Every Triton kernel compiles for a Hopper GPU (sm90, frontend to PTX) on this CPU-only machine.

The interpreter runs kernels as Python and accepts code the GPU compiler rejects (it caught a
function with two returns of different types, which only compiling showed). Compiling needs no
device, only triton's bundled ptxas; it runs in a subprocess without TRITON_INTERPRET, since this
directory's conftest.py sets it for the interpreter tests. One configuration per kernel and
variant, so slow (about 30 s).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

CAST = dict(scale="fp32")


def compile_all() -> list[str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from slipstream.backends.cuda import moe_gemm, paged_attention, turboquant_attention, turboquant_encode

    failures = []

    def build(fn, pointers: dict, constants: dict) -> None:
        signature = {name: pointers.get(name, CAST.get(name, "i32")) for name in fn.arg_names}
        signature.update({name: "constexpr" for name in constants})
        index = {(fn.arg_names.index(name),): value for name, value in constants.items()}
        try:
            triton.compile(ASTSource(fn=fn, signature=signature, constexprs=index), target=GPUTarget("cuda", 90, 32))
        except Exception as error:  # noqa: BLE001 - every failure is reported, with its configuration
            failures.append(f"{fn.__name__} {constants}: {error}")

    for dtype, cache, splits, group in [("bf16", "bf16", 1, 4), ("fp16", "fp16", 4, 3), ("fp32", "fp32", 1, 1),
                                        ("bf16", "u8", 2, 8)]:
        pad = triton.next_power_of_2(group)
        build(paged_attention._paged_attention,
              dict(q=f"*{dtype}", k_cache=f"*{cache}", v_cache=f"*{cache}", out=f"*{dtype}", part_acc="*fp32",
                   part_max="*fp32", part_sum="*fp32", block_table="*i64", seq_lens="*i64", query_start_loc="*i64"),
              dict(G=group, G_PAD=pad, D=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_M=max(1, 16 // pad), BLOCK_N=16,
                   NUM_SPLITS=splits, FP8=cache == "u8", INTERPRETED=False, num_rows=1))  # Triton passes a 1 as a constant
    build(paged_attention._merge_splits, dict(out="*bf16", part_acc="*fp32", part_max="*fp32", part_sum="*fp32"),
          dict(D=128, D_PAD=128, NUM_SPLITS=4))
    codes = {name: "*fp32" for name in ("q", "q_rot", "key_values", "value_values", "key_mean", "out_code",
                                        "out_dense", "part_code", "part_dense", "part_max", "part_sum")}
    codes |= dict(key_rows="*u8", value_rows="*u8", key_table="*i32", value_table="*i32", staging_of="*i64",
                  staged_k="*bf16", staged_v="*bf16", fresh_k="*bf16", fresh_v="*bf16", block_table="*i64",
                  seq_lens="*i64", query_start_loc="*i64")
    for window, splits, dim in [(False, 1, 128), (True, 4, 256)]:
        build(turboquant_attention._turboquant_attention, codes,
              dict(HK=8, G=4, G_PAD=4, D=dim, D_PAD=dim, WK=256, WV=dim, KEY_BYTES=50, VALUE_BYTES=50, BLOCK_SIZE=16,
                   BLOCK_M=4, BLOCK_N=16, HAS_WINDOW=window, NUM_SPLITS=splits, INTERPRETED=False))
    for bits, qjl, group_dim in [(3, False, 128), (2, True, 96), (0, True, 64)]:
        build(turboquant_encode._encode_group,
              dict(x="*fp32", mean="*fp32", scale="*fp32", order="*i32", constants="*fp32", slots="*i64", rows="*u8"),
              dict(HK=8, D=128, NBYTES=50, DG=group_dim, DG_PAD=triton.next_power_of_2(group_dim), MSE_BITS=bits,
                   QJL=qjl, NORM_CORRECTION=not qjl, SCALED=True, PERMUTED=True, BLOCK=16, INTERPRETED=False))
    for act in (0, 1):
        build(moe_gemm._gate_up, dict(x="*bf16", weight="*bf16", tiles="*i32", token="*i64", out="*bf16"),
              dict(ACT=act, BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, INTERPRETED=False))
    build(moe_gemm._down, dict(h="*bf16", weight="*bf16", tiles="*i32", pair_weights="*fp32", out="*fp32"),
          dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, INTERPRETED=False))
    return failures


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


if __name__ == "__main__":
    problems = compile_all()
    print("\n".join(problems) or "every kernel compiled")
    sys.exit(1 if problems else 0)
