"""Every decoder fed random, truncated and well-typed-but-wrong bytes: no crash, no state change, counted."""

import itertools

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.disagg import decode_messenger, prefill_messenger
from serving.messages import (
    ErrorKind,
    HandedBack,
    Result,
    Submit,
    SwitchRole,
    driver_codec,
    worker_codec,
)
from transfer.backends import make_backend
from transfer.backends.local import _CODEC as LOCAL_METADATA
from transfer.backends.nixl import _CODEC as NIXL_METADATA
from transfer.backends.nixl import NixlMetadata
from transfer.config import TransferConfig
from transfer.plan import ShardSpec
from transfer.protocol import (
    Abort,
    Accepted,
    Ended,
    Hello,
    Notif,
    Posted,
    PrefillRequest,
    decode_codec,
    local_channel,
    prefill_codec,
    wait_hello,
)
from transfer.wire import WireError

SPEC = ShardSpec(tp=1, num_kv_heads=2, num_layers=2, num_pages=8, page_size=4, head_dim=8, itemsize=4)
CODECS = {
    "prefill": prefill_codec,
    "decode": decode_codec,
    "driver": driver_codec,
    "worker": worker_codec,
    "nixl-metadata": lambda: NIXL_METADATA,
    "local-metadata": lambda: LOCAL_METADATA,
}
VALID = [
    PrefillRequest("r", [1, 2, 3], [0], SPEC, [b"md"], 0, 7),
    PrefillRequest("r", list(range(1, 10)), [0, 1, 2], SPEC, [b"md"], 0, 7, skip_pages=2),
    Abort("r", 1, "why"),
    Hello.of(SPEC, "agent"),
    Accepted("r", 1),
    Ended("r", 1, None),
    Posted("r", 1, {"d-nic0": [0, 2], "d-nic1": [1, 3]}),
    Submit("r", [1, 2], SamplingParams(max_tokens=4, stop=("x",), logit_bias={3: 1.0})),
    Result.failed("r", ErrorKind.WORKER_LOST, "worker w exited", "w"),
    Result("r", "w", [1], 0.5, None, [0.6], "length", None),
    SwitchRole("decode", ["prefill-0"]),
    HandedBack("decode-1", ["r", "s"]),
    NixlMetadata(b"agent", [(4096, 64, 0)], "DRAM"),
]
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))


def _decodes_or_refuses(codec, data: bytes) -> None:
    try:
        msg = codec.decode(data)
    except WireError:
        return
    assert isinstance(msg, codec.types)


@pytest.mark.parametrize("name", CODECS)
@FUZZ
@given(data=st.binary(max_size=512))
def test_random_bytes_decode_or_are_refused(name, data):
    _decodes_or_refuses(CODECS[name](), data)


@pytest.mark.parametrize("name", CODECS)
@FUZZ
@given(
    which=st.sampled_from(VALID), cut=st.integers(0, 400), flip=st.integers(0, 400), byte=st.integers(0, 255)
)
def test_truncated_and_corrupted_messages_decode_or_are_refused(name, which, cut, flip, byte):
    data = bytearray(msgspec.msgpack.encode(which))
    _decodes_or_refuses(CODECS[name](), bytes(data[: cut % (len(data) + 1)]))
    data[flip % len(data)] = byte
    _decodes_or_refuses(CODECS[name](), bytes(data))


def test_refusals_are_counted():
    codec = prefill_codec()
    for data in (
        b"",
        b"\x00",
        msgspec.msgpack.encode(Accepted("r", 1)),
        msgspec.msgpack.encode({"type": "Evil"}),
    ):
        with pytest.raises(WireError):
            codec.decode(data)
    assert codec.dropped == 4


@pytest.mark.parametrize(
    "posts, why",
    [
        ({f"d-{i}": [i] for i in range(65)}, "at most 64 agents"),
        ({"d" * 301: [0]}, "1-300 characters"),
        ({"": [0]}, "1-300 characters"),
        ({"d-nic0": list(range((1 << 20) + 1))}, "at most 1048576 posts"),
    ],
)
def test_a_posted_naming_too_many_agents_or_posts_is_refused(posts, why):
    """What a decode worker keeps of a Posted until its writes land is bounded."""
    forged = msgspec.msgpack.encode({"type": "Posted", "request_id": "r", "seq": 1, "posts": posts})
    with pytest.raises(WireError, match=why):
        decode_codec().decode(forged)


def test_a_switch_to_a_role_elastic_workers_do_not_have_is_refused():
    codec = worker_codec()
    assert codec.decode(msgspec.msgpack.encode(SwitchRole("prefill"))) == SwitchRole("prefill")
    forged = msgspec.msgpack.encode({"type": "SwitchRole", "role": "colocated", "prefill": []})
    with pytest.raises(WireError, match="SwitchRole.role must be prefill or decode, got colocated"):
        codec.decode(forged)


PAGES = 32


@pytest.fixture(scope="module")
def pair():
    prefill = LLM("tiny-random", role="prefill", page_size=4, num_pages=PAGES, max_num_batched_tokens=24)
    decode = LLM("tiny-random", role="decode", page_size=4, num_pages=PAGES)
    config = TransferConfig(backend="local", context_slots=4)
    decode_end, prefill_end = local_channel()
    pm = prefill_messenger(prefill, make_backend("local", "fuzz-p"), config)
    pm.add_peer(prefill_end)
    dm = decode_messenger(decode, make_backend("local", "fuzz-d"), config)
    dm.add_peer("prefill-0", decode_end, wait_hello(decode_end, timeout_s=1))
    yield prefill, decode, pm, dm, prefill_end, decode_end
    pm.close()


def _bad_requests(dm):
    """Well-typed PrefillRequests (as a hostile decode worker could send) that must all be refused."""
    good = dict(
        request_id="bad", prompt_ids=[5, 6, 7, 8, 9], dst_pages=[0, 1], dst_spec=dm.spec,
        dst_metadata=dm._metadata, context_slot=0, seq=1,
    )  # fmt: skip
    wrong_spec = [
        {"page_size": 8}, {"num_layers": 3}, {"head_dim": 32}, {"dtype": "float16"}, {"num_kv_heads": 4},
        {"tp": 3}, {"num_pages": 10**9}, {"itemsize": 2},
    ]  # fmt: skip
    return st.one_of(
        st.builds(lambda t: {**good, "prompt_ids": [5, t, 7, 8, 9]}, st.integers(49152, 2**63 - 1)),
        st.builds(lambda p: {**good, "dst_pages": [0, p]}, st.integers(PAGES, 2**40)),
        st.builds(lambda s: {**good, "context_slot": s}, st.integers(4, 2**40)),
        # agents' metadata: garbage, none, or more than the decode side's TP ranks
        st.builds(lambda m: {**good, "dst_metadata": m}, st.lists(st.binary(max_size=64), max_size=3)),
        st.builds(lambda n: {**good, "dst_metadata": dm._metadata * n}, st.sampled_from([0, 2, 3])),
        # the decode side's cached pages: none written is no request; a negative count none at all
        st.builds(
            lambda k: {**good, "skip_pages": k}, st.one_of(st.integers(2, 2**62), st.integers(-(2**62), -1))
        ),
        st.builds(
            lambda w: {**good, "dst_spec": {**msgspec.to_builtins(dm.spec), **w}, "dst_pages": [0, 1]},
            st.sampled_from(wrong_spec),
        ),
    )


def test_well_typed_bad_requests_are_refused_and_touch_nothing(pair):
    prefill, decode, pm, dm, prefill_end, decode_end = pair
    before = (prefill.allocator.num_free, len(pm._free_slots), pm.refused, prefill_end.codec.dropped)
    seqs = itertools.count(1)
    seen = []

    @FUZZ
    @given(req=_bad_requests(dm))
    def check(req):
        req = {**req, "seq": next(seqs)}  # each newer than the last, or it would be dropped as stale
        raw = msgspec.msgpack.encode({"type": "PrefillRequest", **req})
        decode_end.outbox.put(raw)  # straight onto the prefill side's inbox, as a hostile peer would
        pm.poll()
        replies = decode_end.receive()
        assert not pm.transfers and not prefill.has_unfinished()
        assert prefill.allocator.num_free == before[0] and len(pm._free_slots) == before[1]
        # refused with an Ended, or dropped by the decoder itself (its own checks), never accepted
        assert all(isinstance(m, Ended) and "refused" in m.error for m in replies)
        seen.append(len(replies))

    check()
    assert pm.refused - before[2] == sum(seen) > 0
    assert prefill_end.codec.dropped - before[3] == len(seen) - sum(seen)  # the rest the decoder refused


def test_bad_notifications_are_dropped_and_counted(pair):
    prefill, decode, pm, dm, _, _ = pair
    dm.submit("live", [5, 6, 7, 8, 9, 10], None)
    pending = dm.pending["live"]

    @FUZZ
    @given(agent=st.sampled_from(["fuzz-p", "stranger"]), data=st.binary(max_size=64))
    def check(agent, data):
        before = sum(dm.dropped.values())
        dm._count(agent, data)
        assert pending.received == 0 and sum(dm.dropped.values()) == before + 1

    check()
    seq = pending.seq
    for agent, msg in [
        ("stranger", Notif("kv", "live", seq, 0, 1)),  # not the owner's agent
        ("fuzz-p", Notif("kv", "live", seq, 0, 999)),  # more writes than the plan
        ("fuzz-p", Notif("kv", "other", seq, 0, 1)),  # a request nobody sent
        ("fuzz-p", Notif("kv", "live", seq - 1, 0, 1)),  # an earlier request of the same id
    ]:
        dm._count(agent, msg.encode())
    assert pending.received == 0
    dm._count("fuzz-p", Notif("kv", "live", seq, 0, 1).encode())
    dm._count("fuzz-p", Notif("kv", "live", seq, 0, 1).encode())  # the same post twice counts once
    assert pending.received == 1
    dm.abort("live")
    for _ in range(50):
        pm.poll()
        dm.poll()
    assert not dm.pending and decode.allocator.num_free == PAGES
