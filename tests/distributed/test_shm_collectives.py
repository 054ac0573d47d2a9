"""The shared-memory all-reduce and all-gather against gloo's (the reference), between real processes."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slipstream.backends.cpu.shm_collectives import SLOT_BYTES, ShmCollectives
from tests.server.conftest import free_port

pytestmark = pytest.mark.skipif(not ShmCollectives.available(), reason="no native kernels (SLIPSTREAM_NATIVE=0)")

SHAPES = [(1, 576), (16, 576), (3, 1000), (7,)]


def _rank_main(rank: int, size: int, port: int, path: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    shm = ShmCollectives(path, rank, size, lambda: True, timeout_s=60)
    dist.barrier()
    mismatches = []
    for step in range(3):  # every slot set is reused
        for dtype in (torch.float32, torch.bfloat16):
            for shape in SHAPES:
                x = torch.randn(shape, generator=torch.Generator().manual_seed(rank * 1000 + step)).to(dtype)
                expected = x.clone()
                dist.all_reduce(expected)
                got = x.clone()
                assert shm.all_reduce(got)
                if not _same_sum(got, expected, size):
                    mismatches.append(("all_reduce", step, dtype, shape))
                parts = [torch.empty_like(x) for _ in range(size)]
                dist.all_gather(parts, x)
                if not torch.equal(shm.all_gather(x, -1), torch.cat(parts, -1)):
                    mismatches.append(("all_gather", step, dtype, shape))
    too_big = torch.zeros(SLOT_BYTES // 4 + 1)
    results.put((rank, mismatches, shm.all_reduce(too_big), shm.all_gather(too_big, 0) is None))
    dist.destroy_process_group()


def _same_sum(got: torch.Tensor, expected: torch.Tensor, size: int) -> bool:
    """Two ranks add a + b, rounded once as gloo does; three may add in another order than gloo's."""
    if size == 2:
        return torch.equal(got, expected)
    bf16 = got.dtype == torch.bfloat16  # an intermediate sum up to ~8 rounds by up to 2^-5
    return torch.allclose(got.float(), expected.float(), rtol=0, atol=6e-2 if bf16 else 1e-5)


@pytest.mark.parametrize("size", [2, 3])
def test_matches_gloo(size, tmp_path):
    context = mp.get_context("spawn")
    results = context.Queue()
    port, path = free_port(), str(tmp_path / "shm")
    procs = [context.Process(target=_rank_main, args=(r, size, port, path, results)) for r in range(size)]
    for p in procs:
        p.start()
    outcomes = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    for rank, mismatches, reduced_too_big, gathered_too_big in outcomes:
        assert mismatches == [], (rank, mismatches)
        assert not reduced_too_big and gathered_too_big  # larger than a slot: left to gloo
    assert [p.exitcode for p in procs] == [0] * size


def _lonely_rank(path: str, results) -> None:
    shm = ShmCollectives(path, 0, 2, lambda: False, timeout_s=60)  # rank 1 never comes
    try:
        shm.all_reduce(torch.ones(4))
        results.put("returned")
    except RuntimeError as e:
        results.put(str(e))


def test_a_gone_rank_is_an_error_not_a_hang(tmp_path):
    context = mp.get_context("spawn")
    results = context.Queue()
    proc = context.Process(target=_lonely_rank, args=(str(tmp_path / "shm"), results))
    proc.start()
    assert "a tensor-parallel rank is gone" in results.get(timeout=60)
    proc.join(10)
