"""AsyncLLMEngine in-process: many streams at once, aborts free blocks, errors reach the right caller."""
from __future__ import annotations

import asyncio
import threading

import pytest
from fastapi.testclient import TestClient

from slipstream.config import EngineConfig
from slipstream.engine.async_engine import AsyncLLMEngine, EngineDeadError
from slipstream.engine.engine import LLMEngine
from slipstream.sampling_params import SamplingParams
from slipstream.server.app import build_app
from tests.conftest import random_prompts
from tests.server.conftest import metric

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def make_engine(model: str) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(model=model, dtype="float32"))


def run_alone(model: str, prompts) -> list[list[int]]:
    engine = make_engine(model)
    outputs = []
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
        while engine.has_unfinished_requests():
            outputs += [o.outputs[0].token_ids for o in engine.step() if o.finished]
    return outputs


@pytest.fixture
def engine(tiny_model):
    async_engine = AsyncLLMEngine(make_engine(tiny_model))
    async_engine.start()
    yield async_engine
    async_engine.shutdown()


async def final(stream):
    last = None
    async for out in stream:
        last = out
    return last


def test_concurrent_streams_equal_each_alone(engine, tiny_model):
    prompts = random_prompts(12, 3, 30, seed=11)

    async def main():
        streams = [await engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
        return await asyncio.gather(*(final(s) for s in streams))

    outputs = asyncio.run(main())
    assert all(o.finished for o in outputs)
    assert [o.outputs[0].token_ids for o in outputs] == run_alone(tiny_model, prompts)


def test_invalid_request_raises_to_its_caller_only(engine):
    async def main():
        good = await engine.add_request("good", [5, 6, 7], GREEDY)
        with pytest.raises(ValueError, match="out of range"):
            await engine.add_request("bad", [10**6], GREEDY)
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("good", [5], GREEDY)
        return await final(good)

    assert len(asyncio.run(main()).outputs[0].token_ids) == 12


def test_prompts_are_processed_off_the_engine_thread(engine, monkeypatch):
    threads = []
    process = engine.processor.process

    def recording(*args):
        threads.append(threading.current_thread().name)
        return process(*args)

    monkeypatch.setattr(engine.processor, "process", recording)

    async def main():
        return await final(await engine.add_request("r", [5, 6, 7], GREEDY))

    assert len(asyncio.run(main()).outputs[0].token_ids) == 12
    assert threads == [threads[0]] and threads[0].startswith("slipstream-input")


def test_input_still_queued_at_shutdown_fails_with_engine_dead(engine):
    release = threading.Event()

    async def main():
        busy = asyncio.ensure_future(engine.run_input(release.wait))  # holds the one input thread
        queued = asyncio.ensure_future(engine.run_input(lambda: "never"))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(engine.shutdown, 1.0, "stopping for the test")
        release.set()
        with pytest.raises(EngineDeadError, match="shutting down"):
            await queued
        assert await busy is True

    asyncio.run(main())


def test_close_aborts_and_frees_blocks(engine):
    long = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)

    async def main():
        stream = engine.open_stream()
        for i in range(3):
            await engine.add_request(f"long{i}", list(range(3, 60)), long, stream=stream)
        async for out in stream:
            if out.outputs[0].token_ids:
                break
        stream.close()
        for _ in range(200):
            await asyncio.sleep(0.01)
            if engine.stats()["num_running"] == 0:
                break

    asyncio.run(main())
    stats = engine.stats()
    assert (stats["num_running"], stats["num_waiting"], stats["num_used_blocks"]) == (0, 0, 0)


def test_engine_error_fails_waiting_streams_and_later_requests(engine, monkeypatch):
    def broken_step():
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(engine.engine, "step", broken_step)

    async def main():
        stream = await engine.add_request("doomed", [5, 6], GREEDY)
        with pytest.raises(EngineDeadError, match="kernel exploded"):
            await final(stream)
        with pytest.raises(EngineDeadError):
            await engine.add_request("later", [5, 6], GREEDY)

    asyncio.run(main())
    assert not engine.is_alive


def test_two_apps_in_one_process_keep_separate_metrics(tiny_model):
    apps = [build_app(make_engine(tiny_model), name) for name in ("a", "b")]
    with TestClient(apps[0]) as a, TestClient(apps[1]) as b:
        assert a.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3, "ignore_eos": True}).status_code == 200
        text_a, text_b = a.get("/metrics").text, b.get("/metrics").text
    assert metric(text_a, "slipstream:generation_tokens_total", model_name="a") == 3
    assert 'model_name="a"' not in text_b and metric(text_b, "slipstream:generation_tokens_total") == 0
    for app in apps:
        assert not app.state.engine.is_alive  # the lifespan stopped each engine thread
