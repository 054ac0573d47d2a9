"""The two ways in: `torchrun --nproc-per-node 2` running a script that builds LLM(tensor_parallel_size=2),
and `slipstream serve --tensor-parallel-size 2` answering the openai client, then reporting a killed
worker as a 503 naming its rank instead of hanging."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import openai
import pytest

from slipstream import LLM, SamplingParams
from tests.conftest import build_tiny_checkpoint
from tests.server.conftest import REPO, free_port, launch_server

PROMPT = [5, 6, 7, 8, 9, 10, 11]
SCRIPT = """
import json, sys
from slipstream import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", tensor_parallel_size=2)
out = llm.generate([{prompt}], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
print("TOKENS", json.dumps(out[0].outputs[0].token_ids), flush=True)
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tp_tiny")), "llama", num_kv_heads=2)


def _expected(path: str, max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return LLM(path, dtype="float32").generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids


def test_torchrun_launch_matches_single_rank(tiny, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(prompt=PROMPT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(script), tiny]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("TOKENS")]
    assert len(lines) == 1, done.stdout  # rank 1 served the model inside LLM(...) and exited there
    assert json.loads(lines[0].split(" ", 1)[1]) == _expected(tiny, 10)


def _worker_pid(parent: int) -> int:
    """The spawned rank-1 process among the server's children (not multiprocessing's resource tracker)."""
    with open(f"/proc/{parent}/task/{parent}/children") as f:
        children = [int(pid) for pid in f.read().split()]
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        if b"spawn_main" in cmdline:
            return pid
    raise AssertionError(f"no spawned worker among the server's children {children}")


def test_server_answers_then_reports_a_dead_worker(tiny, tmp_path):
    server = launch_server(tiny, str(tmp_path / "server.log"), "--tensor-parallel-size", "2",
                           "--served-model-name", "tiny").wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1)
        assert out.usage.completion_tokens == 8
        os.kill(_worker_pid(server.process.pid), signal.SIGKILL)
        with pytest.raises(openai.APIStatusError) as failure:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
        assert failure.value.status_code == 503
        assert "rank 1" in str(failure.value), str(failure.value)
    finally:
        server.stop()
