"""TensorParallelWorker: a rank > 0, running its shard of the model on the steps rank 0 sends.

It builds what every rank builds (worker/worker.py), then loops: receive a message, run the
forward, and the LM head for the rows rank 0 samples from (its all-gather needs every
rank), until rank 0 says to shut down. It never schedules, samples or sees a request.
"""
from __future__ import annotations

import torch

from slipstream.attention.metadata import use_metadata
from slipstream.config import EngineConfig
from slipstream.worker.input_batch import InputBatch
from slipstream.worker.step_channel import FINISH_CALIBRATION, SHUTDOWN, StepChannel
from slipstream.worker.worker import build_worker


class TensorParallelWorker:
    def __init__(self, config: EngineConfig, channel: StepChannel):
        worker = build_worker(config)
        self.model, self.kv_cache = worker.loaded.model, worker.kv_cache
        self.batch = InputBatch.for_cache(config.max_num_batched_tokens, config.max_num_rows, worker.max_model_len,
                                          self.kv_cache, worker.device)
        self.channel = channel

    @torch.inference_mode()
    def run(self) -> None:
        while True:
            op, inputs, logit_rows = self.channel.receive(self.batch)
            if op == SHUTDOWN:
                return
            if op == FINISH_CALIBRATION:
                self.kv_cache.finish_calibration()
                continue
            input_ids, positions, meta = inputs
            with use_metadata(meta):
                hidden = self.model(input_ids, positions)
            if logit_rows:
                self.model.compute_logits(hidden[logit_rows])
