"""TensorParallel: starting or joining the group of ranks, and what rank 0 knows of the others.

Two ways in, one group shape: `LLM(tensor_parallel_size=N)` in a plain process spawns ranks
1..N-1 on this machine (torch.multiprocessing, spawn) and meets them over TCP on loopback;
under `torchrun` (RANK / WORLD_SIZE / MASTER_ADDR set) every process joins through env://,
rank 0 goes on to run the engine, and every other rank serves the model inside the
constructor until rank 0 shuts down, then exits. Each rank has a device group for the
activations' collectives (gloo on CPU, NCCL on CUDA), with a bounded timeout so that a hung
rank ends the step with an error, and a gloo group without one for the step messages,
which may wait for requests for as long as the server is idle; the ranks meet with a
start-up timeout of its own, as a spawned rank imports torch first. Ranks that share one
machine's memory (CPU) exchange activations through a shared mapping instead of gloo.

A rank that dies breaks the group's connections (or, in shared memory, fails the liveness
check of the ranks waiting for it: rank 0 polls its spawned workers, a worker its parent;
torchrun's ranks rely on the timeout): rank 0's collective fails, and `failure()` turns that
into an error naming the dead rank and stops the others, so no worker outlives the engine.
This module never knows models or requests.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slipstream.backends.cpu.shm_collectives import ShmCollectives
from slipstream.config import EngineConfig
from slipstream.distributed.parallel_state import TensorParallelGroup, agree, group, set_group
from slipstream.worker.step_channel import FINISH_CALIBRATION, SHUTDOWN, StepChannel

logger = logging.getLogger("slipstream")

# a collective that waits longer than this inside a step means a rank hung (override: SLIPSTREAM_TP_TIMEOUT, s)
STEP_TIMEOUT_S = 120.0
# ranks meet within at least this at start-up, whatever the step timeout: a spawned rank imports torch first
START_TIMEOUT_S = 120.0
IDLE_TIMEOUT = timedelta(days=365)


@dataclass
class TensorParallel:
    size: int = 1
    launcher: str = "none"  # "spawn" or "torchrun"
    channel: StepChannel | None = None
    workers: list = field(default_factory=list)  # the processes of ranks 1..N-1, where this process spawned them
    threads_before: int = 0  # torch's threads in this process before a rank's share was set; restored at shutdown

    @classmethod
    def start(cls, config: EngineConfig) -> "TensorParallel":
        size = config.tensor_parallel_size
        if size == 1:
            return cls()
        threads_before = torch.get_num_threads()
        threads = max(1, threads_before // size)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            return cls._join_torchrun(config, size, threads)
        url = f"tcp://127.0.0.1:{_free_port()}"
        context = mp.get_context("spawn")
        workers = [context.Process(target=_worker_main, args=(config, rank, url, threads), daemon=True,
                                   name=f"slipstream-tp-rank{rank}") for rank in range(1, size)]
        for worker in workers:
            worker.start()
        parallel = cls(size, "spawn", None, workers, threads_before)
        atexit.register(parallel.shutdown)
        try:
            parallel.channel = _init_group(0, config, url, threads, lambda: all(w.is_alive() for w in workers))
        except BaseException:
            parallel.shutdown()
            raise
        return parallel

    @classmethod
    def _join_torchrun(cls, config: EngineConfig, size: int, threads: int) -> "TensorParallel":
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ValueError(f"tensor_parallel_size={size} must equal torchrun's WORLD_SIZE={world}")
        one_machine = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) == world
        channel = _init_group(rank, config, "env://", threads, (lambda: True) if one_machine else None)
        if rank != 0:
            _serve(config, rank, channel)
            raise SystemExit(0)
        parallel = cls(size, "torchrun", channel)
        atexit.register(parallel.shutdown)
        return parallel

    def describe(self, device: torch.device) -> str:
        launcher = "torchrun's processes" if self.launcher == "torchrun" else "this process + spawned workers"
        return describe_layout(self.size, device, launcher, torch.get_num_threads(), group().shm is not None,
                               group().expert_parallel)

    def finish_calibration(self) -> None:
        if self.channel is not None:
            self.channel.send(FINISH_CALIBRATION)

    def failure(self, error: BaseException) -> RuntimeError:
        """The error to raise for a collective that failed on rank 0; the other ranks are stopped."""
        dead = self._dead_workers()
        self._stop_workers()
        if dead:
            ranks = ", ".join(f"rank {rank} (exit code {code})" for rank, code in dead)
            return RuntimeError(f"tensor-parallel worker {ranks} died; the engine stopped: {error}")
        return RuntimeError(f"a tensor-parallel collective failed (a rank died or hung for more than "
                            f"{_step_timeout():.0f} s); the engine stopped: {error}")

    def shutdown(self) -> None:
        """Tell the workers to exit and wait for them; idempotent."""
        if self.channel is not None:
            try:
                self.channel.send(SHUTDOWN)
            except RuntimeError:  # a worker is already gone
                pass
            self.channel = None
        for worker in self.workers:
            worker.join(10)
        self._stop_workers()
        if dist.is_initialized():
            dist.destroy_process_group()
        set_group(TensorParallelGroup())
        if self.threads_before:
            torch.set_num_threads(self.threads_before)
            self.threads_before = 0

    def _dead_workers(self, grace_s: float = 2.0) -> list[tuple[int, int | None]]:
        """(rank, exit code) of the spawned workers that have exited. A killed worker's sockets close
        while it is still exiting, so a peer's collective can fail before the process is reapable:
        wait a moment for one to show as dead before concluding that none did."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = [(rank, w.exitcode) for rank, w in enumerate(self.workers, 1) if not w.is_alive()]
            if dead or not self.workers or time.monotonic() >= deadline:
                return dead
            time.sleep(0.02)

    def _stop_workers(self) -> None:
        for worker in self.workers:
            if worker.is_alive():
                worker.kill()
            worker.join(5)


def describe_layout(size: int, device: torch.device, launcher: str | None = None, threads: int | None = None,
                    shm: bool | None = None, expert_parallel: bool = False) -> str:
    """The parallel layout as the start-up line and `slipstream info` show it (before a group exists:
    the launcher, threads per rank and transport that `start` would choose)."""
    if size == 1:
        return "tensor parallel: off (1 rank; --tensor-parallel-size N splits every layer over N ranks)"
    launcher = launcher or ("torchrun's processes" if "RANK" in os.environ else "this process + spawned workers")
    threads = threads or max(1, torch.get_num_threads() // size)
    shm = ShmCollectives.available() if shm is None else shm
    comm = ("NCCL activations, gloo step inputs" if device.type == "cuda" else
            "shared-memory activations, gloo step inputs" if shm else "gloo")
    experts = "whole experts" if expert_parallel else "expert features"
    return (f"tensor parallel: {size} ranks ({launcher}; {comm}; {threads} thread(s) per rank): attention heads, "
            f"MLP features, {experts} and vocabulary split {size} ways, KV heads split or copied; "
            "rank 0 schedules and samples")


def _init_group(rank: int, config: EngineConfig, url: str, threads: int, alive) -> StepChannel:
    """Join the group; `alive` (whether the other ranks still exist) is given where they all share
    this machine, and the activations then go through shared memory on CPU."""
    size, device = config.tensor_parallel_size, config.device
    torch.set_num_threads(threads)
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    step = timedelta(seconds=_step_timeout())
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", init_method=url, rank=rank, world_size=size,
                            timeout=max(timedelta(seconds=START_TIMEOUT_S), step))
    device_group = dist.new_group(timeout=step)
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    set_group(TensorParallelGroup(rank, size, device_group, cpu_group, expert_parallel=config.enable_expert_parallel))
    if alive is not None and not cuda:  # the mapping is set up over the group just set
        set_group(dataclasses.replace(group(), shm=_shared_memory(rank, size, alive)))
    return StepChannel(cpu_group, step)


def _shared_memory(rank: int, size: int, alive) -> ShmCollectives | None:
    """One mapping every rank opens, named by a number rank 0 draws; unlinked once all have it."""
    if not agree(int(ShmCollectives.available()), "min"):
        return None
    name = torch.randint(2**62, (1,)) if rank == 0 else torch.zeros(1, dtype=torch.int64)
    dist.broadcast(name, 0, group=group().cpu_group)
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(directory, f"slipstream-tp-{int(name)}")
    shm = ShmCollectives(path, rank, size, alive, _step_timeout())
    dist.barrier(group=group().cpu_group)
    if rank == 0:
        os.unlink(path)
    return shm


def _worker_main(config: EngineConfig, rank: int, url: str, threads: int) -> None:
    parent = os.getppid()
    channel = _init_group(rank, config, url, threads, lambda: os.getppid() == parent)
    _serve(config, rank, channel)


def _serve(config: EngineConfig, rank: int, channel: StepChannel) -> None:
    from slipstream.worker.tp_worker import TensorParallelWorker  # the worker imports the engine's loaders

    try:
        TensorParallelWorker(config, channel).run()
    except Exception:
        logger.exception("tensor-parallel rank %d stopped on an error", rank)
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _step_timeout() -> float:
    return float(os.environ.get("SLIPSTREAM_TP_TIMEOUT", STEP_TIMEOUT_S))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
