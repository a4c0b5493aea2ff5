"""Rails: a rank's agents on several NICs, its writes striped over them, and a rail that stops moving
failed over (transfer/prefill.py). In one process over the local backend, with an agent that holds its
posts as a NIC that went down does (and delivers them late, as TCP does once the link is back)."""

import random
import time

import pytest

from engine import LLM
from engine.disagg import decode_messenger, prefill_messenger
from tests.kept import keep_outputs
from tests.transfer.messengers import GREEDY, PAGES, _run
from transfer.backends.base import TransferError, as_ops
from transfer.backends.local import _AGENTS, LocalBackend
from transfer.config import TransferConfig
from transfer.protocol import local_channel, wait_hello


class Jammable(LocalBackend):
    """A local agent whose NIC can go down: while jammed its posts stay in flight (released or not, as
    NIXL's do), and once unjammed they land late, in whatever agent still answers to their peer's name."""

    def __init__(self, name: str):
        super().__init__(name)
        self.jammed, self.fail_next = False, 0
        self.held: list = []
        self.late_landed = self.late_dropped = 0

    def post(self, peer, ops, notif):
        if self.fail_next:
            self.fail_next -= 1
            self.check(peer, as_ops(ops))
            return "ERR"
        if not self.jammed:
            return super().post(peer, ops, notif)
        ops = as_ops(ops)
        self.check(peer, ops)
        handle = object()
        self.held.append((handle, peer, ops, notif))
        return handle

    def state(self, handle):
        if handle == "ERR":
            return "ERR"
        return "PROC" if any(h is handle for h, *_ in self.held) else "DONE"

    def renewed(self):
        if self.jammed:
            raise TransferError("its NIC is down")
        return super().renewed()

    def unjam(self):
        self.jammed = False
        for _, peer, ops, notif in self.held:
            target = _AGENTS.get(peer)
            if target is None:  # its connection closed (renewed): nothing lands
                self.late_dropped += 1
                continue
            for lr, lo, rr, ro, n in ops.tolist():
                target.regions[rr][ro : ro + n].copy_(self.regions[lr][lo : lo + n])
            target._inbox.append((self.name, notif))
            self.late_landed += 1
        self.held.clear()


class Severed(Jammable):
    """A local agent whose NIC dies with writes in the kernel's buffers: posts on a connection it had
    (to the agents named at sever()) finish at once, as over TCP once the kernel holds them, and never
    land; a new connection cannot be made (UCX: "Destination is unreachable")."""

    def __init__(self, name: str):
        super().__init__(name)
        self.lost_to: set[str] = set()
        self.swallowed = 0

    def sever(self, peers) -> None:
        self.lost_to, self.jammed = set(peers), True

    def post(self, peer, ops, notif):
        if peer in self.lost_to:
            self.check(peer, as_ops(ops))
            self.swallowed += 1
            return "LOST"
        return super().post(peer, ops, notif)

    def state(self, handle):
        return "DONE" if handle == "LOST" else super().state(handle)

    def connect(self, peer_metadata: bytes) -> str:
        peer = super().connect(peer_metadata)
        if self.lost_to and peer not in self.lost_to:
            raise TransferError(f"{peer}: destination is unreachable")
        return peer

    def release(self, handle):
        if handle != "LOST":
            super().release(handle)


def _rails(name, cls=LocalBackend):
    agents = [cls(f"{name}-nic{k}") for k in range(2)]
    for k, agent in enumerate(agents):
        agent.rank, agent.nic = 0, f"eth{k}"
    return agents


@pytest.fixture
def rails(request):
    """tiny-random 1P1D, each side's one rank on two NICs (prefill's jammable, or the class the test
    parametrizes it with), rail_timeout_s 0.2."""
    prefill = LLM("tiny-random", role="prefill", page_size=4, num_pages=PAGES, max_num_batched_tokens=24)
    decode = LLM("tiny-random", role="decode", page_size=4, num_pages=PAGES)
    keep_outputs(prefill), keep_outputs(decode)
    config = TransferConfig(backend="local", rail_timeout_s=0.2)
    tag = request.node.name[-40:]
    sending, receiving = _rails(f"p-{tag}", getattr(request, "param", Jammable)), _rails(f"d-{tag}")
    decode_end, prefill_end = local_channel()
    pm = prefill_messenger(prefill, sending, config)
    pm.add_peer(prefill_end)
    dm = decode_messenger(decode, receiving, config)
    dm.add_peer("prefill-0", decode_end, wait_hello(decode_end, timeout_s=1))
    yield prefill, decode, pm, dm, sending
    pm.close()
    for backend in pm.agents.backends + dm.backends + sending:
        backend.close()


def _long(n, seed):
    """n prompts of 36-132 tokens (several pages a layer: posts on both rails)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(rng.randrange(36, 133))] for _ in range(n)]


def _expected(prompts):
    llm = LLM("tiny-random", page_size=4, num_pages=PAGES)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def _submit(dm, prompts, prefix):
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        dm.submit(rid, prompt, GREEDY)
    return ids


def _run_resending(prefill, decode, pm, dm, prompts, prefix, rounds=3):
    """Submit, run, and send again (as the runtime does, here under a new id; at most `rounds` times)
    each request that failed as lost (the decode side's `peer_lost`); the final id of each prompt, and
    how many sends there were again."""
    ids = _submit(dm, prompts, prefix)
    _run(prefill, decode, pm, dm, ids)
    again = 0
    for n in range(rounds):
        lost = [i for i, rid in enumerate(ids) if rid in dm.peer_lost]
        for i in lost:
            assert "sent again" in decode.output(ids[i]).error
            ids[i] = f"{prefix}{i}-again{n}"
            dm.submit(ids[i], prompts[i], GREEDY)
        _run(prefill, decode, pm, dm, ids)
        again += len(lost)
    return ids, again


def test_each_request_s_kv_is_striped_over_both_rails(rails):
    prefill, decode, pm, dm, sending = rails
    prompts = _long(4, seed=5)
    ids = _submit(dm, prompts, "s")
    _run(prefill, decode, pm, dm, ids)
    assert [decode.output(rid).token_ids for rid in ids] == _expected(prompts)
    both = dm.writes_from
    assert set(both) == {a.name for a in sending} and min(both.values()) >= 0.3 * sum(both.values())
    assert pm.failovers == 0 and dm.renewed == 0


def test_a_rail_that_stops_moving_is_failed_over_and_used_again_once_back(rails):
    """NIC 1 of the prefill host goes down before the requests come: its posts stay in flight, and after
    rail_timeout_s its agent is retired and every post it held goes over NIC 0; the decode side renews its
    agent on NIC 1 before it counts them, so the writes the link delivers once it is back land nowhere, and
    fails the requests still landing as lost (over TCP a post the kernel holds counts as done, and may
    never land), to be sent again. No request is lost, every page comes back on both sides, and the tokens
    are the colocated ones. While the NIC is down its agent's successor cannot start; once it is back and
    the back-off is over, one does and the rail carries writes again."""
    prefill, decode, pm, dm, sending = rails
    sending[1].jammed = True
    prompts = _long(4, seed=6)
    ids, again = _run_resending(prefill, decode, pm, dm, prompts, "f")
    assert again >= 1 and [decode.output(rid).error for rid in ids] == [None] * len(ids)
    assert [decode.output(rid).token_ids for rid in ids] == _expected(prompts)
    assert pm.failovers == 1 and pm.reposted >= 1 and dm.renewed == 1
    assert sending[1].held and pm.rails.retired == {1}
    names = [b.name for b in dm.backends]  # the decode agent on NIC 1 renewed, NIC 0's kept
    assert names[1].endswith("~1") and "~" not in names[0]
    held = len(sending[1].held)
    sending[1].unjam()  # the link is back: what the old connection still carried lands nowhere
    assert sending[1].late_dropped == held and sending[1].late_landed == 0
    assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES
    assert not dm.pending and not pm.transfers

    deadline = time.monotonic() + 30
    while pm.rails.retired and time.monotonic() < deadline:  # the sender thread starts its successor
        time.sleep(0.01)
    assert not pm.rails.retired
    before = dict(dm.writes_from)
    more = _long(4, seed=7)
    ids, again = _run_resending(prefill, decode, pm, dm, more, "g")
    assert again == 0 and [decode.output(rid).token_ids for rid in ids] == _expected(more)
    renewed = pm.agents.backends[1].name
    assert renewed.endswith("~1") and dm.writes_from[renewed] > before.get(renewed, 0)
    assert pm.failovers == 1 and prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES


@pytest.mark.parametrize("rails", [Severed], indirect=True)
def test_writes_a_dead_nic_swallowed_after_its_posts_finished_are_missed_and_sent_again(rails):
    """NIC 1 dies with writes in its buffers: posts to the agent it was connected to finish on the
    prefill side and never land, and no post of this side stays stuck to say so. Its Posted (each decode
    agent's posts) lets the decode side find the missing ones past rail_timeout_s: it renews that agent
    and the request is sent again; the successor cannot be reached over the dead NIC, so the prefill side
    routes the request's writes over the other rail (before, that failed connection refused every request:
    0 of 6 in a suite run). No request is lost (before Posted, one waited out its stage deadline: once in
    a loaded suite, 5 minutes, and then failed)."""
    prefill, decode, pm, dm, sending = rails
    sending[1].sever([b.name for b in dm.backends])
    prompts = _long(2, seed=9)
    ids, again = _run_resending(prefill, decode, pm, dm, prompts, "l")
    assert sending[1].swallowed >= 1 and again >= 1 and dm.renewed >= 1
    assert [decode.output(rid).error for rid in ids] == [None] * len(ids)
    assert [decode.output(rid).token_ids for rid in ids] == _expected(prompts)
    assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES


def test_a_failed_post_goes_again_over_the_other_rail(rails):
    """A post that fails (NIXL's ERR) is sent again over the rank's other rail, naming the decode agent it
    went to (renewed: it may have landed in part; the requests still landing are sent again), and later
    posts of any request avoid that agent: no request is lost."""
    prefill, decode, pm, dm, sending = rails
    sending[1].fail_next = 2
    prompts = _long(3, seed=8)
    ids, _ = _run_resending(prefill, decode, pm, dm, prompts, "e")
    assert [decode.output(rid).token_ids for rid in ids] == _expected(prompts)
    assert all(decode.output(rid).finish_reason == "length" for rid in ids)
    assert sending[1].fail_next == 0 and pm.reposted >= 1 and pm.failovers == 0
    assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES


def test_with_one_rail_a_stuck_post_is_waited_for():
    """One NIC: nothing to fail over to, so a post the link holds is waited for (TCP retransmits once
    the link is back), as before rails."""
    prefill = LLM("tiny-random", role="prefill", page_size=4, num_pages=PAGES, max_num_batched_tokens=24)
    decode = LLM("tiny-random", role="decode", page_size=4, num_pages=PAGES)
    keep_outputs(prefill), keep_outputs(decode)
    config = TransferConfig(backend="local", rail_timeout_s=0.05)
    sending = Jammable("p-one-rail")
    receiving = LocalBackend("d-one-rail")
    decode_end, prefill_end = local_channel()
    pm = prefill_messenger(prefill, sending, config)
    pm.add_peer(prefill_end)
    dm = decode_messenger(decode, receiving, config)
    dm.add_peer("prefill-0", decode_end, wait_hello(decode_end, timeout_s=1))
    try:
        sending.jammed = True
        prompts = _long(2, seed=9)
        ids = _submit(dm, prompts, "w")
        deadline = time.monotonic() + 30
        while len(sending.held) < 2 and time.monotonic() < deadline:  # both requests' posts held
            pm.poll(), prefill.has_unfinished() and prefill.step(), dm.poll()
        time.sleep(0.2)  # four rail timeouts: still waited for
        pm.poll(), dm.poll()
        assert pm.failovers == 0 and sending.held and pm.agents.backends[0] is sending
        sending.jammed = False
        sending.unjam()
        _run(prefill, decode, pm, dm, ids)
        assert [decode.output(rid).token_ids for rid in ids] == _expected(prompts)
    finally:
        pm.close()
        for backend in pm.agents.backends + dm.backends:
            backend.close()
    assert prefill.allocator.num_free == PAGES and decode.allocator.num_free == PAGES


def test_a_rail_s_rate_counts_backlogged_posts_whole_and_none_weighs_under_half_the_fastest():
    from transfer.rails import Rates

    rates = Rates(3)
    for _ in range(3):  # agent 0: three 4 MB posts at once, all found done at one poll 1 s later
        rates.posted(0, 0.0)
    for _ in range(3):
        rates.finished(0, 4_000_000, 1.0)
    assert rates.finished_rate(0) == pytest.approx(8e6)  # the last had none behind it: not counted
    rates.posted(1, 0.0)  # agent 1: one post at a time (the latency sets its time, not the link)
    rates.finished(1, 1_000_000, 0.001)
    assert rates.finished_rate(1) is None
    for _ in range(2):  # agent 2: a slow backlogged rail
        rates.posted(2, 0.0)
    rates.finished(2, 1_000_000, 1.0)
    assert rates.weights() == {0: pytest.approx(8e6), 2: pytest.approx(4e6)}  # 1e6 raised to half of 8e6


def test_a_post_is_cut_at_one_mib_and_keeps_every_write_once():
    import numpy as np

    from transfer.rails import MAX_POST_BYTES
    from transfer.rails import parts_of as _parts

    ops = np.array([[0, i * 10, 0, i * 10, 300_000] for i in range(40)], dtype=np.int64)
    parts = _parts(ops)
    assert np.array_equal(np.concatenate(parts), ops) and len(parts) > 1
    assert all(int(p[:, 4].sum()) <= MAX_POST_BYTES for p in parts)
    big = np.array([[0, 0, 0, 0, 3 * MAX_POST_BYTES]], dtype=np.int64)
    assert [len(p) for p in _parts(big)] == [1]  # a write larger than a post goes alone, whole
