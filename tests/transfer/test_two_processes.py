"""The messenger across two real processes: NIXL (UCX on loopback) for KV, pyzmq for control."""

import multiprocessing as mp
import os
import socket
import time

import pytest

from engine import LLM
from tests.transfer.test_messenger import (
    GREEDY,
    DecodeSide,
    PrefillSide,
    _decode_messenger,
    _prefill_messenger,
    _prompts,
    _spec,
)
from transfer.backends import make_backend
from transfer.protocol import Hello

pytest.importorskip("nixl_cu12")
pytest.importorskip("zmq")
PAGES = 128


def _prefill_worker(address: str, budget: int):
    """A prefill worker process: its own engine, NIXL agent and messenger, serving until killed."""
    from pdkernels import ops
    from transfer.channel import ZmqEndpoint

    ops.set_backend("torch")
    prefill = LLM("tiny-random", role="prefill", page_size=4, num_pages=PAGES, max_num_batched_tokens=budget)
    channel = ZmqEndpoint(address, bind=False)
    pm = _prefill_messenger(PrefillSide(prefill), make_backend("nixl", f"prefill-{os.getpid()}"), channel)
    channel.send(Hello(_spec(prefill)))
    while os.getppid() != 1:
        pm.poll()
        if prefill.has_unfinished():
            prefill.step()
        else:
            time.sleep(0.001)


@pytest.fixture
def decode_pair():
    from transfer.channel import ZmqEndpoint

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    channel = ZmqEndpoint(f"tcp://127.0.0.1:{port}", bind=True)
    proc = mp.get_context("spawn").Process(
        target=_prefill_worker, args=(f"tcp://127.0.0.1:{port}", 16), daemon=True
    )
    proc.start()
    hello, give_up = [], time.monotonic() + 120
    while not hello:
        hello = [m for m in channel.receive() if isinstance(m, Hello)]
        assert time.monotonic() < give_up and proc.is_alive(), "the prefill worker did not start"
        time.sleep(0.01)
    decode = LLM("tiny-random", role="decode", page_size=4, num_pages=PAGES)
    dm = _decode_messenger(
        DecodeSide(decode),
        make_backend("nixl", f"decode-{os.getpid()}"),
        channel,
        hello[0].spec,
        deadline_s=60,
        peer_timeout_s=2.0,
    )
    yield decode, dm, proc
    proc.kill()
    proc.join(timeout=10)
    dm.backend.close()
    channel.close()


def _drive(decode, dm, ids, give_up_s=120):
    give_up = time.monotonic() + give_up_s
    while not all(decode.seqs[i].finished for i in ids) or dm.pending:
        dm.poll()
        if decode.has_unfinished():
            decode.step()
        assert time.monotonic() < give_up, "requests did not finish"


def test_two_process_disaggregation_matches_colocated(decode_pair):
    decode, dm, _ = decode_pair
    prompts = _prompts(6, seed=4)
    expected = [
        o.token_ids for o in LLM("tiny-random", page_size=4, num_pages=PAGES).generate(prompts, GREEDY)
    ]
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        dm.submit(rid, prompt)
    _drive(decode, dm, ids)
    assert [decode.output(rid).token_ids for rid in ids] == expected
    assert decode.allocator.num_free == PAGES


def test_killed_prefill_worker_fails_its_requests_and_frees_pages(decode_pair):
    decode, dm, proc = decode_pair
    dm.submit("long", list(range(100, 400)))  # 299 tokens in 16-token chunks: many passes
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
