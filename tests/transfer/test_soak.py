"""Soak (`make soak`, marked slow): 10,000 tiny-random requests through a real 1P1D pair (a prefill
process over NIXL and CURVE-authenticated pyzmq), with aborts from both sides and the prefill process
killed and restarted about every 2,000 requests. At the end no page or context slot is held on either
side, the decode process's resident memory grew under 5% after warm-up, and nothing hung."""

import multiprocessing as mp
import os
import random
import time

import pytest

from engine import LLM, SamplingParams
from engine.disagg import decode_messenger
from transfer.backends import make_backend
from transfer.config import TransferConfig

pytest.importorskip("nixl_cu12")
PAGES, SLOTS, IN_FLIGHT = 256, 32, 16
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _prefill_process(address, creds, parent, abort_rate, seed, report):
    """A prefill worker that aborts a fraction of its requests itself; on request, reports its free pages
    and context slots."""
    import torch

    from engine.disagg import prefill_messenger
    from pdkernels import ops
    from transfer.channel import ZmqEndpoint
    from transfer.protocol import prefill_codec

    ops.set_backend("torch")
    torch.set_num_threads(1)
    rng = random.Random(seed)
    llm = LLM("tiny-random", role="prefill", page_size=4, num_pages=PAGES, max_num_batched_tokens=64)
    config = TransferConfig(context_slots=SLOTS)
    pm = prefill_messenger(llm, make_backend("nixl", f"soak-p-{os.getpid()}"), config)
    pm.add_peer(ZmqEndpoint(address, False, creds, "decode-0", prefill_codec()))
    seen = set()
    while os.getppid() == parent:
        pm.poll()
        for rid in [r for r in pm.transfers if r not in seen]:  # each new request: abort a few
            seen.add(rid)
            if rng.random() < abort_rate:
                pm.abort(rid, "prefill worker draining")
        if len(seen) > 10_000:
            seen &= set(pm.transfers)
        if llm.has_unfinished():
            llm.step()
        else:
            time.sleep(0.0005)
        if os.path.exists(report + ".ask"):
            os.remove(report + ".ask")
            with open(report, "w") as f:
                f.write(f"{llm.allocator.num_free} {len(pm._free_slots)} {len(pm.transfers)}")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # ten minutes of traffic and more (the suite's ceiling is 900 s)
def test_soak_10000_requests_with_aborts_and_prefill_restarts(tmp_path):
    from transfer.auth import keyring
    from transfer.channel import ZmqEndpoint
    from transfer.protocol import decode_codec, wait_hello

    total, restart_every = 10_000, 2_000
    rng = random.Random(0)
    keys = keyring(["decode-0", "prefill-0"])
    channel = ZmqEndpoint(f"ipc://{tmp_path}/soak", True, keys["decode-0"], "prefill-0", decode_codec())
    ctx = mp.get_context("spawn")
    report = str(tmp_path / "prefill-report")

    def start_prefill(seed):
        args = (channel.address, keys["prefill-0"], os.getpid(), 0.02, seed, report)
        proc = ctx.Process(target=_prefill_process, args=args, daemon=True)
        proc.start()
        return proc, wait_hello(channel, timeout_s=120, alive=proc.is_alive)

    decode = LLM("tiny-random", role="decode", page_size=4, num_pages=PAGES, max_num_seqs=IN_FLIGHT)
    config = TransferConfig(context_slots=SLOTS, peer_timeout_s=5)
    dm = decode_messenger(decode, make_backend("nixl", f"soak-d-{os.getpid()}"), config)
    proc, hello = start_prefill(1)
    dm.add_peer("prefill-0", channel, hello)
    live, done, outcomes, restarts, rss = set(), 0, {"length": 0, "error": 0}, 0, []
    waiting: dict = {}  # finished requests whose transfer has not settled yet
    start, give_up = time.monotonic(), time.monotonic() + 1800
    try:
        while done < total:
            assert time.monotonic() < give_up, f"hung after {done} requests"
            while len(live) < IN_FLIGHT and done + len(live) < total:
                rid = f"r{done + len(live)}-{rng.randrange(1 << 30)}"
                prompt = [rng.randrange(3, 49000) for _ in range(rng.randrange(2, 64))]
                try:
                    dm.submit(rid, prompt, PARAMS)
                except Exception:  # out of pages: the running requests give them back
                    break
                live.add(rid)
            if dm.pending and rng.random() < 0.01:
                dm.abort(rng.choice(sorted(dm.pending)), "client went away")
            dm.poll()
            ended = {o.request_id: o for o in decode.step() if o.finished} if decode.has_unfinished() else {}
            waiting.update(ended)  # handed back once; its transfer may still have to settle
            for rid in [r for r in waiting if r not in dm.pending]:
                reason = waiting.pop(rid).finish_reason
                outcomes[reason] = outcomes.get(reason, 0) + 1
                dm.forget(rid)
                live.discard(rid)
                done += 1
                if done == 1_000:
                    rss.append(_rss_mib())
                if done % restart_every == 0 and done < total:
                    proc.kill()
                    proc.join(timeout=10)
                    dm.peer_dead("prefill-0")
                    proc, hello = start_prefill(done)
                    dm.add_peer("prefill-0", channel, hello)
                    restarts += 1
        rss.append(_rss_mib())
        open(report + ".ask", "w").close()
        give = time.monotonic() + 30
        while not os.path.exists(report) and time.monotonic() < give:
            dm.poll()
            time.sleep(0.01)
        prefill_free, prefill_slots, prefill_transfers = map(int, open(report).read().split())
    finally:
        proc.kill()
        proc.join(timeout=10)
        dm.backend.close()
        channel.close()
    growth = rss[1] / rss[0] - 1
    print(
        f"\nsoak: {total} requests in {time.monotonic() - start:.0f} s, outcomes {outcomes}, "
        f"{restarts} prefill restarts, decode messenger dropped {dict(dm.dropped)}; "
        f"decode RSS {rss[0]:.1f} -> {rss[1]:.1f} MiB "
        f"({100 * growth:+.1f}%)"
    )
    assert decode.allocator.num_free == PAGES and len(dm._free_slots) == SLOTS and not dm.pending
    assert (prefill_free, prefill_slots, prefill_transfers) == (PAGES, SLOTS, 0)
    assert not decode.core.seqs and not dm.timings  # nothing kept per finished request
    assert outcomes["length"] > total // 2 and outcomes["error"] > 0 and restarts == 4
    assert growth < 0.05
