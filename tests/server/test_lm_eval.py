"""lm-eval-harness on the server: its `local-completions` model scores a task as its own `hf` model does.

A ten-question multiple-choice task is written as local files (a task YAML over a jsonl). lm-eval
runs it twice on the bundled SmolLM2 GGUF in float32: through `/v1/completions` (echo + logprobs,
its scoring request, prompts as token ids) and with transformers in this process. Every
(context, continuation) loglikelihood of the two runs must agree within TOLERANCE. Offline: no
model hub, no dataset hub.
"""
from __future__ import annotations

import json
import os

import pytest

from tests.server.conftest import launch_server

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
KV_MEMORY = 128 * 2**20
TASK = "slipstream_capitals"
# measured: max |difference| 2.2e-5 over the 40 loglikelihoods (values -22.1 to -1.4), the same in
# two runs: float32 rounding in two implementations of one forward pass
TOLERANCE = 1e-4
QUESTIONS = [
    ("What is the capital of France?", ["Berlin", "Paris", "Madrid", "Rome"], 1),
    ("What is the capital of Japan?", ["Tokyo", "Seoul", "Beijing", "Bangkok"], 0),
    ("What is the capital of Italy?", ["Milan", "Naples", "Rome", "Turin"], 2),
    ("What is the capital of Germany?", ["Munich", "Hamburg", "Frankfurt", "Berlin"], 3),
    ("What is the capital of Spain?", ["Madrid", "Barcelona", "Seville", "Valencia"], 0),
    ("What is the capital of Canada?", ["Toronto", "Ottawa", "Vancouver", "Montreal"], 1),
    ("How many legs does a spider have?", ["six", "four", "eight", "ten"], 2),
    ("What color is the sky on a clear day?", ["green", "red", "yellow", "blue"], 3),
    ("Which planet is closest to the Sun?", ["Mercury", "Venus", "Earth", "Mars"], 0),
    ("What do bees make?", ["milk", "honey", "silk", "wax paper"], 1),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("lm_eval_server") / "server.log")
    server = launch_server(MODEL, log, "--kv-cache-memory", str(KV_MEMORY)).wait_ready()
    yield server
    server.stop()


def write_task(folder) -> str:
    """The task as lm-eval reads it from `include_path`; JSON is YAML, so the task file is JSON text."""
    data = folder / "capitals.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in QUESTIONS))
    task = {"task": TASK, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "Question: {{question}}\nAnswer:",
            "doc_to_choice": "choices", "doc_to_target": "answer", "metric_list": [{"metric": "acc"}]}
    (folder / f"{TASK}.yaml").write_text(json.dumps(task, indent=1))
    return str(folder)


def loglikelihoods(model: str, model_args: dict, include_path: str, **kwargs) -> dict:
    """{(doc_id, choice index): (context, continuation, loglikelihood)} from one lm-eval run."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], log_samples=True,
                                      task_manager=TaskManager(include_path=include_path), **kwargs)
    return {(sample["doc_id"], i): (*arguments[:2], float(resp[0][0]))
            for sample in results["samples"][TASK]
            for i, (arguments, resp) in enumerate(zip(sample["arguments"], sample["resps"]))}


def test_local_completions_matches_hf_loglikelihoods(server, smollm2_gguf, tmp_path, monkeypatch):
    import huggingface_hub.constants
    import transformers

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once, at its import
    (tmp_path / "task").mkdir()
    include_path = write_task(tmp_path / "task")
    folder, gguf_file = os.path.split(smollm2_gguf)
    # local-completions takes a tokenizer directory, not a GGUF: the one transformers builds from it
    tokenizer = str(tmp_path / "tokenizer")
    transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file).save_pretrained(tokenizer)

    served = loglikelihoods("local-completions", {
        "base_url": f"{server.url}/v1/completions", "model": MODEL, "tokenizer_backend": "huggingface",
        "tokenizer": tokenizer, "max_retries": 1}, include_path, batch_size=4)
    reference = loglikelihoods("hf", {"pretrained": folder, "gguf_file": gguf_file, "dtype": "float32"},
                               include_path, batch_size=1, device="cpu")

    assert len(reference) == sum(len(choices) for _, choices, _ in QUESTIONS)
    assert served.keys() == reference.keys()
    for key, (context, continuation, _) in reference.items():
        assert served[key][:2] == (context, continuation), key
    worst = max(reference, key=lambda key: abs(served[key][2] - reference[key][2]))
    difference = abs(served[worst][2] - reference[worst][2])
    assert difference <= TOLERANCE, (f"{worst} {reference[worst][:2]}: served {served[worst][2]}, "
                                     f"hf {reference[worst][2]}, |difference| {difference}")
