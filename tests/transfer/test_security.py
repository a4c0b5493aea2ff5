"""The control plane against a hostile local process: no unpickling, no unauthenticated peer, no stolen
pair, no message counted from a peer that does not own its request."""

import os
import pickle
import time

import pytest
import zmq

from transfer import auth
from transfer.auth import keyring
from transfer.channel import ZmqEndpoint
from transfer.plan import ShardSpec
from transfer.protocol import Accepted, Ended, Hello, decode_codec, prefill_codec

SPEC = ShardSpec(tp=1, num_kv_heads=2, num_layers=2, num_pages=8, page_size=4, head_dim=8, itemsize=4)


class _Boom:
    """Unpickling this runs a command that creates `path`."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _receive_for(endpoint, seconds=0.5):
    out, give_up = [], time.monotonic() + seconds
    while time.monotonic() < give_up:
        out += endpoint.receive()
        time.sleep(0.01)
    return out


def _attacker(address, curve_keys=None, server_key=None):
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    if curve_keys is not None:
        sock.curve_publickey, sock.curve_secretkey = curve_keys
        sock.curve_serverkey = server_key
    sock.connect(address)
    return sock


@pytest.fixture
def bound(tmp_path):
    keys = keyring(["decode-0", "prefill-0"])
    end = ZmqEndpoint(f"ipc://{tmp_path}/d", True, keys["decode-0"], "prefill-0", decode_codec())
    yield keys, end
    end.close()


@pytest.mark.parametrize("curve", ["none", "stranger-key"])
def test_stranger_is_refused_and_does_not_take_the_pair(bound, tmp_path, curve):
    keys, end = bound
    marker = tmp_path / "pwned"
    stranger = (
        _attacker(end.address)
        if curve == "none"
        else _attacker(end.address, zmq.curve_keypair(), keys["decode-0"].public)
    )
    before = sum(auth.refused.values())
    # it connects first, then sends a pickle payload and a forged Hello; a refused handshake may drop its
    # pipe before a send, and a PAIR socket without a pipe would block that send for good: never block
    for payload in (pickle.dumps(_Boom(marker)), decode_codec().encode(Hello.of(SPEC, "evil-agent"))):
        try:
            stranger.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            pass
    assert _receive_for(end) == []
    assert not marker.exists()
    if curve == "stranger-key":
        assert sum(auth.refused.values()) > before  # refused in the handshake, and counted
    real = ZmqEndpoint(end.address, False, keys["prefill-0"], "decode-0", prefill_codec())
    real.send(Hello.of(SPEC, "prefill-agent"))
    got = _receive_for(end)
    assert [type(m) for m in got] == [Hello] and got[0].agents == ["prefill-agent"]
    stranger.close()
    real.close()


def test_member_sending_pickle_is_dropped_and_counted(bound, tmp_path):
    keys, end = bound
    marker = tmp_path / "pwned"
    peer = ZmqEndpoint(end.address, False, keys["prefill-0"], "decode-0", prefill_codec())
    peer._sock.send(pickle.dumps(_Boom(marker)))  # a member's key does not make pickle welcome
    peer.send(Accepted("r0", 1))
    got = _receive_for(end)
    assert got == [Accepted("r0", 1)] and end.codec.dropped == 1 and not marker.exists()
    peer.close()


def test_a_channel_decodes_only_its_direction(bound):
    keys, end = bound
    peer = ZmqEndpoint(end.address, False, keys["prefill-0"], "decode-0", prefill_codec())
    peer.send(Ended("r0", 1, None))
    peer._sock.send(prefill_codec().encode(Accepted("x", 2)))  # fine: decode side accepts Accepted
    from transfer.protocol import Abort

    peer._sock.send(decode_codec().encode(Abort("r0", 1, "x")))  # a prefill-bound message: refused here
    got = _receive_for(end)
    assert got == [Ended("r0", 1, None), Accepted("x", 2)] and end.codec.dropped == 1
    peer.close()


def test_received_objects_run_their_own_checks():
    codec = decode_codec()
    good = codec.encode(Hello.of(SPEC, "a"))
    bad = good.replace(b"\xa2tp\x01", b"\xa2tp\x00")  # tp=0 inside the ShardSpec
    assert bad != good
    with pytest.raises(ValueError, match="tp must be >= 1"):
        codec.decode(bad)


def test_driver_drops_a_worker_that_claims_another_identity(tmp_path):
    from serving.control import driver_socket, recv_all
    from serving.messages import Ready, worker_codec
    from transfer.config import TransferConfig

    keys = keyring(["driver", "decode-0", "prefill-0"])
    sock = driver_socket(keys, str(tmp_path), TransferConfig())
    address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    ctx = zmq.Context.instance()
    workers = []
    for identity, member in (("decode-0", "prefill-0"), ("prefill-0", "prefill-0")):
        w = ctx.socket(zmq.DEALER)
        w.setsockopt(zmq.LINGER, 0)
        w.setsockopt(zmq.IDENTITY, identity.encode())
        auth.connect_as(w, keys[member], "driver")
        w.connect(address)
        w.send(worker_codec().encode(Ready(identity)))
        workers.append(w)
    got, give_up = [], time.monotonic() + 2
    while len(got) < 1 and time.monotonic() < give_up:
        sock.poll(50)
        got += recv_all(sock)
    time.sleep(0.2)
    got += recv_all(sock)
    assert got == [("prefill-0", Ready("prefill-0"))]  # prefill-0's key cannot speak as decode-0
    for w in workers:
        w.close()
    sock.close()


def test_driver_socket_runs_no_pickle_from_a_stranger_or_a_member(tmp_path):
    from serving.control import driver_socket, recv_all
    from transfer.config import TransferConfig

    keys = keyring(["driver", "decode-0"])
    sock = driver_socket(keys, str(tmp_path), TransferConfig())
    address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    marker = tmp_path / "pwned"
    ctx = zmq.Context.instance()
    stranger, member = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for s, name in ((stranger, "decode-0"), (member, "decode-0")):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IDENTITY, name.encode())
    auth.connect_as(member, keys["decode-0"], "driver")
    stranger.connect(address)
    member.connect(address)
    stranger.send(pickle.dumps(_Boom(marker)))
    member.send(pickle.dumps(_Boom(marker)))
    got, give_up = [], time.monotonic() + 1
    while time.monotonic() < give_up:
        sock.poll(50)
        got += recv_all(sock)
    assert got == [] and not marker.exists()
    for s in (stranger, member, sock):
        s.close()


def test_a_peer_of_another_protocol_version_is_refused():
    from transfer.protocol import PROTOCOL_VERSION, local_channel, wait_hello

    decode_end, prefill_end = local_channel()
    prefill_end.send(Hello(SPEC, ["agent"], PROTOCOL_VERSION - 1))
    with pytest.raises(ValueError, match="protocol version"):
        wait_hello(decode_end, timeout_s=1)
