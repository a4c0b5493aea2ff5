"""The messenger across two real processes: NIXL (UCX on loopback) for KV, pyzmq for control."""

import contextlib
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time

import pytest
import torch

from engine import LLM, make_llm
from engine.disagg import DecodeSide, PrefillSide, decode_messenger, prefill_messenger, shard_spec
from tests.kept import finished, keep_outputs
from tests.transfer.messengers import GREEDY, _full_heads, _prompts
from transfer.backends import rank_agents
from transfer.config import TransferConfig
from transfer.plan import plan_array
from transfer.protocol import wait_hello

pytest.importorskip("nixl_cu12")
pytest.importorskip("zmq")
PAGES = 128


def _prefill_worker(addresses, creds, model, tp, page_size, num_pages, budget, parent, sent, stop, tmp):
    """A prefill worker process: its own engine (and TP ranks), NIXL agents (one per rank, as a worker's)
    and messenger, until `stop` is
    set or its parent goes, then closed; its temporary files in `tmp` (the test's, removed after it, so a
    worker the test kills leaves nothing either). With more than one address, DP groups, each with its
    messenger and agent, group r's on addresses[r]. `sent` receives ("kv", request, the KV it computed)
    just before group 0's pages are freed, and ("pass", start, end) for each of group 0's forward passes."""
    from pdkernels import ops
    from transfer.channel import ZmqEndpoint
    from transfer.protocol import prefill_codec

    os.environ["TMPDIR"], tempfile.tempdir = tmp, None
    ops.set_backend("torch")
    torch.set_num_threads(1)
    dp = len(addresses)
    llm = make_llm(
        model,
        tp=tp,
        dp=dp,
        role="prefill",
        page_size=page_size,
        num_pages=num_pages,
        max_num_batched_tokens=budget,
    )

    class Source(PrefillSide):
        def release(self, request_id):
            sent.put(("kv", request_id, _full_heads(llm.kv_caches, shard_spec(llm), self.pages(request_id))))
            super().release(request_id)

    run = llm.runner.run

    def timed_run(batch, counter=None):  # each forward pass's start and end, on the machine-wide clock
        start = time.perf_counter()
        out = run(batch, counter)
        sent.put(("pass", start, time.perf_counter()))
        return out

    llm.runner.run = timed_run

    pm = prefill_messenger(llm, rank_agents(TransferConfig(), f"prefill-{os.getpid()}", tp), side=Source)
    pm.add_peer(ZmqEndpoint(addresses[0], False, creds, "decode-0", prefill_codec()))
    if dp > 1:
        peers = {r: [("decode-0", addresses[r])] for r in range(1, dp)}
        llm.front.start_group_messengers(TransferConfig(), f"prefill-{os.getpid()}", peers, creds)
    while os.getppid() == parent and not stop.is_set():
        pm.poll()
        llm.front.poll_groups()
        if llm.has_unfinished():
            llm.step()
        else:
            time.sleep(0.001)
    pm.close()
    llm.close()


@contextlib.contextmanager
def disaggregated(
    prefill_tp=1,
    decode_tp=1,
    model="tiny-random",
    page_size=4,
    num_pages=PAGES,
    budget=16,
    sink=DecodeSide,
    peer_timeout_s=2.0,
    decode_dp=1,
    prefill_dp=1,
):
    """A prefill worker process and, here, a decode engine with its messenger, wired over NIXL + pyzmq
    (decode_dp > 1: DP groups, the others' engines in processes of their own, an agent for each group;
    prefill_dp > 1: the prefill worker's groups, each a prefill peer of its own: prefill-0, prefill-0-dp1)."""
    from transfer.auth import keyring
    from transfer.channel import ZmqEndpoint
    from transfer.protocol import decode_codec

    keys = keyring(["decode-0", "prefill-0"])
    # one control channel per prefill DP group, each authenticated as prefill-0 (the same worker)
    channels = [
        ZmqEndpoint("tcp://127.0.0.1:0", True, keys["decode-0"], "prefill-0", decode_codec())
        for _ in range(prefill_dp)
    ]
    ctx = mp.get_context("spawn")
    sent, stop, tmp = ctx.Queue(), ctx.Event(), tempfile.mkdtemp(prefix="pdk-2p-")
    args = (
        [c.address for c in channels],
        keys["prefill-0"],
        model,
        prefill_tp,
        page_size,
        num_pages,
        budget,
        os.getpid(),
        sent,
        stop,
        tmp,
    )
    proc = ctx.Process(target=_prefill_worker, args=args)  # not a daemon: it starts its own TP ranks
    proc.start()
    decode = dm = None
    try:
        hellos = [wait_hello(c, timeout_s=300, alive=proc.is_alive) for c in channels]
        decode = make_llm(
            model, tp=decode_tp, role="decode", page_size=page_size, num_pages=num_pages, dp=decode_dp
        )
        keep_outputs(decode)
        config = TransferConfig(peer_timeout_s=peer_timeout_s)
        name = f"decode-{os.getpid()}"  # an agent per rank of each DP group, as a worker has
        groups = [rank_agents(config, f"{name}-dp{r}", decode_tp, r) for r in range(1, decode_dp)]
        agents = rank_agents(config, name, decode_tp)
        dm = decode_messenger(decode, agents, config, side=sink, group_backends=groups)
        for r, (channel, hello) in enumerate(zip(channels, hellos, strict=True)):
            dm.add_peer("prefill-0" if r == 0 else f"prefill-0-dp{r}", channel, hello)
        yield decode, dm, proc, sent
    finally:
        stop.set()  # it closes its engine (its TP ranks and DP groups) and messenger
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
        if dm is not None:
            for backend in dm.backends:
                backend.close()
        if decode is not None:
            decode.close()
        for channel in channels:
            channel.close()


def _drain(sent, kv_entries):
    """Every entry of the worker's queue, waiting until kv_entries ("kv", ...) ones have come."""
    got = []
    with contextlib.suppress(queue.Empty):
        while sum(g[0] == "kv" for g in got) < kv_entries:
            got.append(sent.get(timeout=30))
        while True:
            got.append(sent.get(timeout=0.5))
    return got


def _drive(decode, dm, ids, give_up_s=120):
    give_up = time.monotonic() + give_up_s
    while not all(finished(decode, i) for i in ids) or dm.pending:
        dm.poll()
        if decode.has_unfinished():
            decode.step()
        assert time.monotonic() < give_up, "requests did not finish"


@pytest.mark.parametrize(  # make test: the mismatched pairs on DeepSeek's latent cache, replicated on
    # every rank (1 -> 1 over two processes is the SmolLM2 test below; GQA's 2 -> 1, 1 -> 2 and replicated
    # 4 -> 1 run in make test through the in-process messenger, tests/transfer/test_messenger.py)
    "model, prefill_tp, decode_tp",
    [
        pytest.param("tiny-random", 1, 1, marks=pytest.mark.slow),
        pytest.param("tiny-random", 2, 1, marks=pytest.mark.slow),
        pytest.param("tiny-random", 1, 2, marks=pytest.mark.slow),
        pytest.param("tiny-random", 4, 2, marks=pytest.mark.slow),
        pytest.param("tiny-random-deepseek", 2, 1, marks=pytest.mark.slow),
        ("tiny-random-deepseek", 1, 2),
    ],
)
def test_two_process_disaggregation_moves_the_computed_bytes(model, prefill_tp, decode_tp):
    prompts = _prompts(6, seed=4)
    expected = [o.token_ids for o in LLM(model, page_size=4, num_pages=PAGES).generate(prompts, GREEDY)]
    landed = {}

    class Sink(DecodeSide):
        def admit(self, request_id, context):  # what landed, before decoding appends to the pages
            llm = self.llm
            landed[request_id] = _full_heads(llm.kv_caches, shard_spec(llm), llm.allocator.pages(request_id))
            super().admit(request_id, context)

    with disaggregated(prefill_tp, decode_tp, model=model, sink=Sink) as (decode, dm, _, sent):
        ids = [f"r{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts, strict=True):
            dm.submit(rid, prompt, GREEDY)
        _drive(decode, dm, ids)
        computed = {rid: kv for kind, rid, kv in _drain(sent, len(landed)) if kind == "kv"}
        multi = [rid for rid, p in zip(ids, prompts, strict=True) if len(p) > 1]
        assert sorted(landed) == sorted(computed) == sorted(multi)
        for rid in multi:
            if prefill_tp <= 2:  # one holder per head: exactly the bytes the prefill ranks computed
                assert torch.equal(landed[rid], computed[rid]), rid
            else:  # replicas computed on different ranks may round differently; pages rotate over them
                torch.testing.assert_close(landed[rid], computed[rid], atol=1e-5, rtol=1e-5)
        if prefill_tp <= 2:  # a 4-way all-reduce sums in another order and may flip a greedy near-tie
            assert [decode.output(rid).token_ids for rid in ids] == expected
        assert all(decode.output(rid).finish_reason == "length" for rid in ids)
        assert decode.allocator.num_free == PAGES
        # each prefill rank's own agent sent its heads (or its turn of the replicated latent's pages)
        senders = dm.peers["prefill-0"].hello.agents
        assert len(senders) == prefill_tp and set(dm.writes_from) == set(senders)
        total = sum(dm.writes_from.values())
        assert all(dm.writes_from[a] >= total / (prefill_tp + 1) for a in senders), dm.writes_from


def test_killed_prefill_worker_fails_its_requests_and_frees_pages():
    with disaggregated() as (decode, dm, proc, _):
        dm.submit("long", list(range(100, 400)), GREEDY)  # 299 tokens in 16-token chunks: many passes
        give_up = time.monotonic() + 120
        while not dm.pending["long"].received:  # some layers of some pages have landed
            dm.poll()
            assert time.monotonic() < give_up
        proc.kill()
        proc.join(timeout=10)
        _drive(decode, dm, ["long"], give_up_s=30)
        out = decode.output("long")
        assert out.finish_reason == "error" and "silent" in out.error and not out.token_ids
        assert decode.allocator.num_free == PAGES


def test_smollm2_across_two_processes_streams_layers_and_matches_colocated():
    """SmolLM2 (30 layers) over NIXL: tokens equal colocated, and the first write lands on the decode side
    while the prefill worker's forward pass that computed it is still running."""
    prompts = [list(range(1000, 1220)), list(range(2000, 2070))]
    expected = [o.token_ids for o in LLM("smollm2-135m", num_pages=64).generate(prompts, GREEDY)]
    # heartbeats go out between forward passes: the timeout must outlast the longest pass
    smollm2 = dict(model="smollm2-135m", page_size=16, num_pages=64, budget=512, peer_timeout_s=30)
    with disaggregated(**smollm2) as (decode, dm, _, sent):
        ids = ["r0", "r1"]
        for rid, prompt in zip(ids, prompts, strict=True):
            dm.submit(rid, prompt, GREEDY)
        _drive(decode, dm, ids, give_up_s=300)
        assert [decode.output(rid).token_ids for rid in ids] == expected
        passes = [(start, end) for kind, start, end in _drain(sent, 2) if kind == "pass"]
        (start, end), timing = passes[0], dm.timings["r0"]  # one 288-token pass holds both prompts
        print(
            f"prefill pass {1e3 * (end - start):.0f} ms; first write landed at "
            f"+{1e3 * (timing.first_landed - start):.0f} ms, "
            f"released at +{1e3 * (timing.landed - start):.0f} ms"
        )
        assert start < timing.first_landed < end, "nothing landed before the forward pass ended"


def test_a_conversation_over_nixl_writes_only_the_pages_the_decode_cache_lacks():
    """Prefill TP 2 -> decode TP 1, three turns of one conversation: from turn 2 on the decode worker holds
    the history's pages, its request skips them, and the writes that land (counted from the notifications,
    none dropped) are the plan of the rest; the KV of every page equals what the prefill ranks computed
    and the replies equal colocated ones without a cache."""
    landed = {}

    class Sink(DecodeSide):
        def admit(self, request_id, context):
            llm = self.llm
            landed[request_id] = _full_heads(llm.kv_caches, shard_spec(llm), llm.allocator.pages(request_id))
            super().admit(request_id, context)

    reference = LLM("tiny-random", page_size=4, num_pages=PAGES, enable_prefix_caching=False)
    with disaggregated(prefill_tp=2, sink=Sink) as (decode, dm, _, sent):
        prompt, turns = list(range(100, 139)), []
        for t in range(3):
            rid = f"turn{t}"
            dm.submit(rid, prompt, GREEDY)
            _drive(decode, dm, [rid])
            out = decode.output(rid)
            assert out.token_ids == reference.generate([prompt], GREEDY)[0].token_ids
            turns.append((rid, prompt, out.num_cached_tokens))
            prompt = prompt + out.token_ids + [50 + t, 51, 52, 53, 54, 55]
        computed = {rid: kv for kind, rid, kv in _drain(sent, 3) if kind == "kv"}
        spec = dm.peers["prefill-0"].hello.spec
        for rid, prompt, cached in turns:
            pages = -(-(len(prompt) - 1) // 4)
            rest = list(range(pages - cached // 4))
            assert dm.timings[rid].writes == len(plan_array(spec, shard_spec(decode), rest, rest)) + 1
            torch.testing.assert_close(landed[rid], computed[rid], atol=1e-5, rtol=1e-5)
        assert [c for _, _, c in turns] == [0, 44, 60]  # the history's full pages, to the last reply token
        assert not dm.dropped and decode.allocator.num_free == PAGES


# make test: the replicated latent's 2 -> DP 2 (1 -> DP 2 runs through the main job: test_run_dp.py)
@pytest.mark.slow  # make test: DP groups over NIXL in the main job (tests/experiments/test_run_dp.py)
@pytest.mark.parametrize("prefill_tp", [1, 2])
def test_prefill_tp_into_decode_dp_groups_over_nixl(prefill_tp):
    """Prefill TP 1 or 2 -> a decode worker of 2 DP groups (DeepSeek's latent cache, data-parallel
    attention, the experts over both groups): each request's KV lands in the pages of the group it was
    given, through that group's own agent, equal to what the prefill ranks computed, and the tokens equal
    colocated TP 1 (fp32); both groups get their pages back."""
    prompts = _prompts(6, seed=5)
    model = "tiny-random-deepseek"
    expected = [o.token_ids for o in LLM(model, page_size=4, num_pages=PAGES).generate(prompts, GREEDY)]
    landed, pages = {}, {}

    class Sink(DecodeSide):  # runs in this process for both groups (group 1's KV is mapped here)
        def reserve(self, request_id, prompt_ids, params, load_within_s=0.0):
            pages[request_id], held = super().reserve(request_id, prompt_ids, params, load_within_s)
            return pages[request_id], held

        def admit(self, request_id, context):
            if context is not None:  # its KV came from the prefill worker (a 1-token prompt's did not)
                caches = self.llm.front.group_kv_regions(self.group)  # fp32: the caches
                kv = _full_heads(caches, shard_spec(self.llm), pages[request_id])
                landed[request_id] = (self.group, kv)
            super().admit(request_id, context)

    with disaggregated(prefill_tp, model=model, sink=Sink, decode_dp=2) as (decode, dm, _, sent):
        assert len(dm.groups) == 2 and len({g.metadata[0] for g in dm.groups}) == 2  # an agent each
        ids = [f"r{i}" for i in range(len(prompts))]
        for i, (rid, prompt) in enumerate(zip(ids, prompts, strict=True)):
            dm.submit(rid, prompt, GREEDY, group=i % 2)
        _drive(decode, dm, ids)
        computed = {rid: kv for kind, rid, kv in _drain(sent, len(landed)) if kind == "kv"}
        multi = [i for i, p in enumerate(prompts) if len(p) > 1]
        assert sorted(landed) == sorted(computed) == sorted(ids[i] for i in multi)
        assert {landed[ids[i]][0] for i in multi} == {0, 1}  # both groups received KV
        for i in multi:
            group, kv = landed[ids[i]]
            assert group == i % 2
            torch.testing.assert_close(kv, computed[ids[i]], atol=1e-5, rtol=1e-5)
        assert [decode.output(rid).token_ids for rid in ids] == expected
        assert not dm.dropped
        assert decode.pages == (2 * PAGES, 2 * PAGES)  # every group's, after a step that reported them


@pytest.mark.slow  # make test: DP -> DP in the main job (tests/experiments/test_run_dp.py)
@pytest.mark.parametrize("decode_dp", [1, 2])
def test_prefill_dp_groups_each_send_their_own_requests_over_nixl(decode_dp):
    """A prefill worker of 2 DP groups -> decode TP 1 or 2 DP groups: each prefill group is a prefill peer
    of its own (its messenger, layer counter and NIXL agent in its engine's process), the decode side
    spreads requests over both, and the tokens equal colocated TP 1 (fp32)."""
    prompts = [p for p in _prompts(8, seed=6) if len(p) > 1]
    model = "tiny-random-deepseek"
    expected = [o.token_ids for o in LLM(model, page_size=4, num_pages=PAGES).generate(prompts, GREEDY)]
    with disaggregated(model=model, prefill_dp=2, decode_dp=decode_dp) as (decode, dm, _, _):
        hellos = [p.hello for p in dm.peers.values()]
        assert len(hellos) == 2 and len({h.agents[0] for h in hellos}) == len({h.pid for h in hellos}) == 2
        ids = [f"r{i}" for i in range(len(prompts))]
        for i, (rid, prompt) in enumerate(zip(ids, prompts, strict=True)):
            peer = "prefill-0" if i % 2 == 0 else "prefill-0-dp1"
            dm.submit(rid, prompt, GREEDY, peer=peer, group=i % decode_dp)
        _drive(decode, dm, ids)
        assert [decode.output(rid).token_ids for rid in ids] == expected
        assert {dm.timings[rid].peer for rid in ids} == {"prefill-0", "prefill-0-dp1"}
        assert not dm.dropped and decode.pages == (decode_dp * PAGES, decode_dp * PAGES)
