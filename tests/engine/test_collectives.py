"""engine.collectives over two gloo processes: the all-gather path for small tensors and gloo's
all-reduce for large ones give the same sums on every rank; any_true agrees."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine import collectives


def _rank(rank: int, rendezvous: str, out) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        got = {}
        for name, shape in (("small", (3, 5)), ("large", (1024, 520))):  # 2 x 2.1 MB gathered: all-reduce
            x = torch.full(shape, float(rank + 1)) + torch.arange(shape[1], dtype=torch.float32)
            got[name] = collectives.all_sum(x).tolist()  # lists: a tensor would cross as a shared file
            # whose sharer may be gone with this process before the test reads it
        got["any"] = (collectives.any_true(rank == 1), collectives.any_true(False))
        out.put((rank, got))
    finally:
        dist.destroy_process_group()


def test_all_sum_and_any_true_agree_on_every_rank(tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "rv"), out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for name, shape in (("small", (3, 5)), ("large", (1024, 520))):
        want = 3.0 + 2 * torch.arange(shape[1], dtype=torch.float32).expand(shape)
        for rank in (0, 1):
            torch.testing.assert_close(torch.tensor(results[rank][name]), want, rtol=0, atol=0)
    assert results[0]["any"] == results[1]["any"] == (True, False)
    assert collectives.GATHER_MAX_BYTES < 2 * 1024 * 520 * 4  # the large one took gloo's all-reduce
