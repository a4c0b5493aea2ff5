"""The messenger tests' two engines and both messenger halves in one process (local backend)."""

import random
import time

import torch

from engine import SamplingParams
from engine.disagg import DecodeSide, PrefillSide, decode_messenger, prefill_messenger
from engine.kv.cache import OutOfPages
from tests.kept import finished, keep_outputs
from transfer.backends import make_backend
from transfer.config import TransferConfig
from transfer.decode import NoFreeSlot
from transfer.protocol import local_channel, wait_hello

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


PAGES = 128


def _agents(name, tp, per_rank):
    """Local agents for a side of tp ranks: one per rank (as workers have), or one for all."""
    return (
        [make_backend("local", f"{name}-tp{t}") for t in range(tp)]
        if per_rank
        else make_backend("local", name)
    )


def _local_pair(
    prefill,
    decode,
    tag,
    source=PrefillSide,
    sink=DecodeSide,
    per_rank=(True, True),
    kv_dtype="auto",
    **config,
):
    """Both messenger halves in this process: local backend, in-process control queues. per_rank: whether
    the prefill and the decode side have an agent per TP rank (a worker's) or one for all their ranks (a
    decode engine of DP groups: agents for each group); kv_dtype: what the KV crosses as
    (engine.disagg.prefill_messenger)."""
    config = TransferConfig(backend="local", **config)
    keep_outputs(prefill), keep_outputs(decode)
    decode_end, prefill_end = local_channel()
    agents = _agents(f"p-{tag}", prefill.config.tp, per_rank[0])
    pm = prefill_messenger(prefill, agents, config, side=source, kv_dtype=kv_dtype)
    pm.add_peer(prefill_end)
    tp, dp = decode.config.tp, decode.config.dp
    groups = [_agents(f"d-{tag}-dp{r}", tp, per_rank[1]) for r in range(1, dp)]
    dm = decode_messenger(
        decode, _agents(f"d-{tag}", tp, per_rank[1]), config, side=sink, group_backends=groups
    )
    dm.add_peer("prefill-0", decode_end, wait_hello(decode_end, timeout_s=1))
    return pm, dm


def _refetching_worker(decode, dm, backlog: list, params, refetched: list | None = None):
    """A decode worker's turn (_run's tick): its preempted requests first, each fetched again into the DP
    group that holds it, then backlog's (request id, token ids, group), while pages last; True once the
    backlog is empty. refetched: what was fetched again is appended there."""

    def tick() -> bool:
        again = [
            (s.request_id, s.all_ids, decode.front.dp_rank_of(s.request_id))
            for s in decode.front.take_refetches()
        ]
        if refetched is not None:
            refetched.extend(again)
        backlog[:0] = again
        while backlog:
            rid, ids, group = backlog[0]
            try:
                dm.submit(rid, ids, params, group=group)
            except (OutOfPages, NoFreeSlot):  # pages, or a context slot, come back as others finish
                break
            backlog.pop(0)
        return not backlog

    return tick


def _close(pm, dm):
    pm.close()
    for backend in pm.agents.backends + dm.backends:  # every rank's and DP group's agent
        backend.close()


def _run(prefill, decode, pm, dm, ids, prefill_polls=True, timeout_s=60.0, tick=None):
    """Drive both sides until ids finished; tick (a worker's own chores) runs first each turn and says
    whether it has nothing left to do. Bounded in time, not turns: a turn that only polls takes
    microseconds, and a count of them ran out before a control message arrived under a loaded suite."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        idle = tick() if tick is not None else True
        if prefill_polls:
            pm.poll()
            if prefill.has_unfinished():
                prefill.step()
        dm.poll()
        if decode.has_unfinished():
            decode.step()
        held = dm.pending or dm.fenced or pm.transfers
        if idle and all(finished(decode, i) for i in ids) and not held:
            return
    raise AssertionError("requests did not finish")


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(rng.choice([1, 2, 9, 17, 33]))] for _ in range(n)]


def _full_heads(caches, spec, pages):
    """[layers, pages, 2, all kv heads, P, D] assembled from each head's first holder rank."""
    parts = []
    for head in range(spec.num_kv_heads):
        rank = spec.holders(head)[0]
        parts.append(caches[rank][:, pages, :, head - spec.first_head(rank)])
    return torch.stack(parts, dim=3)
