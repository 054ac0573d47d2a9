"""LLMEngine: add_request / step / abort_request over the scheduler and the model runner.

One `step()` schedules a batch (a SchedulerOutput), runs the model once on it, appends the
sampled tokens, checks stop conditions, frees finished sequences and registers newly
filled blocks in the prefix cache. With speculative decoding a sequence may gain several
tokens in a step: those up to the first that stops it count, and the lookahead blocks of
rejected drafts are released. It returns a RequestOutput (cumulative so far) for every
request that progressed. Inputs are validated by the InputProcessor, outputs built by the
OutputProcessor; structured-output grammars are validated at add_request and compiled on
the GrammarCompiler's thread while the step loop goes on. With tensor_parallel_size > 1 this
is rank 0: it starts or joins the other ranks first, and its runner sends them every step.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import time

import torch

from slipstream.config import EngineConfig
from slipstream.distributed.launcher import TensorParallel
from slipstream.engine.block_manager import BlockManager
from slipstream.engine.output import OutputProcessor
from slipstream.engine.processor import InputProcessor, ProcessedPrompt
from slipstream.engine.request import Request
from slipstream.engine.scheduler import Scheduler
from slipstream.engine.scheduler_output import SchedulerOutput
from slipstream.engine.sequence import Sequence
from slipstream.kvcache.calibration import MAX_TOKENS as CALIBRATION_TOKENS, calibration_text
from slipstream.layers.logits_processors import default_processors
from slipstream.layers.sampler import Sampler
from slipstream.outputs import RequestMetrics, RequestOutput
from slipstream.sampling_params import SamplingParams
from slipstream.speculative.draft_model import DraftModelProposer
from slipstream.speculative.ngram import NgramProposer
from slipstream.speculative.speculator import Speculator
from slipstream.structured.bitmask import GrammarBitmask
from slipstream.structured.grammars import GrammarCompiler
from slipstream.worker.model_runner import ModelRunner, RunnerOutput
from slipstream.worker.worker import build_worker

logger = logging.getLogger("slipstream")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.parallel = TensorParallel.start(config)
        try:
            self._build(config)
        except BaseException:
            self.parallel.shutdown()
            raise

    def _build(self, config: EngineConfig) -> None:
        worker = build_worker(config)
        self.device, self.dtype, self.backend, self.kv_cache = worker.device, worker.dtype, worker.backend, worker.kv_cache
        loaded = worker.loaded
        self.model_path, self.model_config = loaded.path, loaded.config
        self.tokenizer, self.quantization = loaded.tokenizer, loaded.quantization
        if config.deterministic:
            self._check_deterministic(loaded.model)
        self.max_model_len = worker.max_model_len
        num_blocks = self.kv_cache.num_blocks - (0 if config.enforce_eager else 1)  # the last: CUDA graphs' scratch
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          stale_head=self.kv_cache.stale_head)
        self.speculator = self._speculator(config, loaded) if config.speculative_config is not None else None
        # a TurboQuant window sized by default serves kv_cache.window_seqs sequences at once: run no more
        self.scheduler = Scheduler(self.block_manager, min(config.max_num_seqs, self.kv_cache.window_seqs),
                                   config.max_num_batched_tokens, self.speculator)
        eos = self.model_config.eos_token_ids
        vocab = self.model_config.vocab_size
        sampler = Sampler([GrammarBitmask(vocab)] + default_processors(eos))
        self.runner = ModelRunner(loaded.model, self.kv_cache, self.backend, sampler,
                                  config.max_num_batched_tokens, config.max_num_rows, self.max_model_len,
                                  self.parallel.channel, 1 + config.num_speculative_tokens)
        if not config.enforce_eager:
            self.runner.graphs = self.backend.decode_graphs(loaded.model, self.kv_cache, config.max_num_seqs,
                                                            self.max_model_len)
        self.grammars = GrammarCompiler(self.tokenizer, vocab, eos)
        self._compiling: set[concurrent.futures.Future] = set()
        self._grammar_failures: queue.SimpleQueue[tuple[str, BaseException]] = queue.SimpleQueue()
        self.processor = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                                        num_blocks, config.block_size)
        self.output_processor = OutputProcessor(self.tokenizer, eos, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._last_log = time.monotonic()
        if self.kv_cache.needs_calibration:
            self._calibrate_kv_cache()
        logger.info("model %s (%s) on %s, %s, weights %s; KV cache %s, %.0f MiB: %d blocks x %d "
                    "tokens = %d tokens, %d bytes/token", config.model, self.model_config.architecture, self.device,
                    str(self.dtype).replace("torch.", ""), _weights_description(loaded.quantization),
                    self.kv_cache.describe(),
                    self.kv_cache.num_blocks * self.kv_cache.bytes_per_token * config.block_size / 2**20,
                    self.kv_cache.num_blocks, config.block_size,
                    self.kv_cache.num_blocks * config.block_size, self.kv_cache.bytes_per_token)
        for line in [*self.backend.describe(), self.parallel.describe(self.device)]:
            logger.info("%s", line)

    def _speculator(self, config: EngineConfig, loaded) -> Speculator:
        spec = config.speculative_config
        if spec.method == "ngram":
            return Speculator(spec, NgramProposer(spec), self.max_model_len)
        draft = DraftModelProposer(spec, config, loaded, self.kv_cache.num_blocks * config.block_size)
        return Speculator(spec, draft, min(self.max_model_len, draft.max_model_len))

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do with one); the engine takes no steps after it."""
        self.parallel.shutdown()

    def _check_deterministic(self, model) -> None:
        """deterministic=True is honoured or refused: the parts no invariant kernel serves are named."""
        gaps = [f"dtype {self.dtype} (bfloat16 only)"] * (self.dtype != torch.bfloat16)
        gaps += [f"quantization {self.quantization!r} (None, 'int8', 'int4' or 'gguf' only)"] * (
            self.quantization not in (None, "int8", "int4", "gguf"))
        gaps += [f"kv_cache_dtype {self.config.kv_cache_dtype!r} (a bfloat16 cache only)"] * (
            self.kv_cache.kv_dtype.dense != torch.bfloat16)
        gaps += self.backend.invariance_gaps(model)
        if gaps:
            raise ValueError("deterministic=True: batch invariance does not cover " + "; ".join(gaps))

    def _calibrate_kv_cache(self) -> None:
        """Run a fixed prompt first, so TurboQuant's constants never depend on user traffic.

        Its blocks hold no codes, so a random cache salt keeps any request from reusing them.
        """
        if self.tokenizer is not None:
            prompt = self.tokenizer(calibration_text()).input_ids
        else:
            prompt = list(range(1, min(self.model_config.vocab_size, 257)))
        fits = min(self.max_model_len, self.kv_cache.num_blocks * self.config.block_size, CALIBRATION_TOKENS + 1) - 1
        self.add_request("calibration", prompt[:fits], SamplingParams(temperature=0, max_tokens=1),
                         cache_salt=os.urandom(16).hex())
        while self.has_unfinished_requests():
            self.step()
        self.kv_cache.finish_calibration()
        self.parallel.finish_calibration()
        self.block_manager.prefix_cache_queries = self.block_manager.prefix_cache_hits = 0

    # --- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> None:
        """Validate and queue a request; a request that can never run is rejected here."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.add_processed(request_id, self.processor.process(prompt, params or SamplingParams()), arrival_time,
                           cache_salt)

    def add_processed(self, request_id: str, processed: ProcessedPrompt, arrival_time: float | None = None,
                      cache_salt: str | None = None) -> None:
        """Queue a request that self.processor has already validated (the server tokenizes on its own thread)."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_text, token_ids, params = processed
        grammar = self._submit_grammar(request_id, params)
        metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic())
        seqs = [Sequence(request_id, token_ids, params, metrics, i, cache_salt, grammar) for i in range(params.n)]
        self.requests[request_id] = Request(request_id, prompt_text, token_ids, params, seqs, metrics)
        for seq in seqs:
            self.scheduler.add(seq)

    def _submit_grammar(self, request_id: str, params: SamplingParams) -> concurrent.futures.Future | None:
        if params.structured_outputs is None:
            return None
        future = self.grammars.submit(params.structured_outputs)  # ValueError if the spec is invalid
        if not future.done():
            self._compiling.add(future)
        def on_done(f: concurrent.futures.Future) -> None:  # on the compiler's thread
            if f.exception() is not None:
                self._grammar_failures.put((request_id, f.exception()))

        future.add_done_callback(on_done)
        return future

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        request.metrics.finished_time = time.monotonic()
        return request.output()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        failed = self._abort_failed_grammars()
        scheduled = self.scheduler.schedule()
        if not scheduled.scheduled:
            self._wait_for_grammars()
        now = time.monotonic()
        for s in scheduled.scheduled:
            metrics = self.scheduler.sequences[s.seq_id].metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
        start = time.perf_counter()
        try:
            result = self.runner.execute(scheduled)
        except RuntimeError as e:
            if self.parallel.size == 1:
                raise
            raise self.parallel.failure(e) from e
        if self.speculator is not None:
            self.speculator.observe(time.perf_counter() - start)
        progressed = self._update(scheduled, result)
        self._maybe_log_stats()
        return failed + [self._request_output(r) for r in progressed]

    def _abort_failed_grammars(self) -> list[RequestOutput]:
        """Requests whose grammar failed to compile (validation passed, so this is the library's failure)."""
        outputs = []
        while not self._grammar_failures.empty():
            request_id, error = self._grammar_failures.get()
            logger.error("request %s: its grammar failed to compile: %s", request_id, error)
            output = self.abort_request(request_id)
            if output is not None:
                outputs.append(output)
        return outputs

    def _wait_for_grammars(self) -> None:
        """Nothing to run but grammars to compile: sleep until one is done (briefly, so commands still run)."""
        self._compiling = {f for f in self._compiling if not f.done()}
        if self._compiling:
            concurrent.futures.wait(self._compiling, timeout=0.01, return_when=concurrent.futures.FIRST_COMPLETED)

    def _update(self, scheduled: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        now = time.monotonic()
        progressed: dict[str, Request] = {}
        for s in scheduled.scheduled:
            seq = self.scheduler.sequences[s.seq_id]
            if s.seq_id in result.prompt_logprobs:
                seq.prompt_logprobs.extend(self.output_processor.logprob_entries(*e)
                                           for e in result.prompt_logprobs[s.seq_id])
            samples = result.sampled.get(s.seq_id, [])
            self._append(seq, samples, now)
            # K/V of the rejected drafts is not the sequence's; a stop at an accepted draft leaves all computed
            rejected = len(s.spec_token_ids) - max(len(samples) - 1, 0)
            seq.advance(s.num_new_tokens - rejected)
            self.block_manager.cache_full_blocks(seq)
            if s.spec_token_ids:
                self.speculator.record(seq, len(s.spec_token_ids), len(samples) - 1)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
            elif s.spec_token_ids:
                self.scheduler.release_lookahead(seq)
            if samples:
                progressed[seq.request_id] = self.requests[seq.request_id]
        return list(progressed.values())

    def _append(self, seq: Sequence, samples: list, now: float) -> None:
        """The step's tokens, up to the first that finishes the sequence (later ones are dropped)."""
        for sample in samples:
            self.output_processor.append(seq, sample)
            if seq.finish_reason is not None:
                break
        if samples:
            metrics = seq.metrics
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
            metrics.num_generation_tokens = max(metrics.num_generation_tokens, seq.num_output_tokens)

    def _request_output(self, request: Request) -> RequestOutput:
        if request.finished:
            request.metrics.finished_time = request.metrics.finished_time or time.monotonic()
            del self.requests[request.request_id]
        return request.output()

    # --- stats -------------------------------------------------------------------------
    def stats(self) -> dict:
        bm = self.block_manager
        queries = bm.prefix_cache_queries
        return {
            "num_blocks": bm.num_blocks,
            "num_used_blocks": bm.num_used_blocks,
            "num_cached_blocks": bm.num_cached_free_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "kv_cache_usage": bm.num_used_blocks / bm.num_blocks,
            "kv_bytes_per_token": self.kv_cache.bytes_per_token,
            "block_size": bm.block_size,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "prefix_cache_hit_rate": bm.prefix_cache_hits / queries if queries else 0.0,
            "num_preemptions": self.scheduler.num_preemptions,
            "fragmentation": bm.fragmentation(self.scheduler.running),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            **(self.speculator.stats() if self.speculator else {}),
            # MoE models: tokens routed to each expert, per layer
            **({"expert_load": load} if (load := self.runner.model.routing_stats()) else {}),
        }

    def _maybe_log_stats(self) -> None:
        interval = self.config.log_stats_interval
        if interval is None or time.monotonic() - self._last_log < interval:
            return
        self._last_log = time.monotonic()
        s = self.stats()
        logger.info("running %d, waiting %d, KV usage %.1f%%, prefix hit rate %.1f%%, preemptions %d, "
                    "fragmentation %.1f%%", s["num_running"], s["num_waiting"], 100 * s["kv_cache_usage"],
                    100 * s["prefix_cache_hit_rate"], s["num_preemptions"], 100 * s["fragmentation"])



def _weights_description(quantization: str | None) -> str:
    return {None: "as loaded", "gguf": "as the GGUF file stores them (quantization='gguf')"}.get(
        quantization, f"quantization={quantization!r}")
