"""What sealing costs a page in the shared pool (engine/kv/pool.py): a SmolLM2-135M page (bf16, 16
tokens: 368,640 bytes of KV and its header) put into and got from a Mooncake Store on this machine,
sealed (AES-GCM into the client's buffer), against the same bytes moved unsealed."""

import itertools
import os
import tempfile

import pytest
import torch

from tests import needs

needs.nixl()
PLAIN = 128 + 30 * 2 * 3 * 16 * 64 * 2  # header + 30 layers x (K, V) x 3 heads x 16 tokens x 64 x bf16
ROUNDS = 200


@pytest.fixture(scope="module")
def pool():
    from engine.kv.pool import PoolTier
    from transfer.backends.mooncake import LOOKUP_S, StoreProcesses

    store = StoreProcesses("127.0.0.1", 512 << 20, tempfile.mkdtemp(prefix="bench-pool-"))
    tier = PoolTier(store.master, store.metadata, b"s" * 16, b"bench secret", PLAIN, 5.0, LOOKUP_S)
    yield tier
    tier.close()
    store.stop()


def _names():
    return (os.urandom(32) for _ in itertools.count())


@pytest.mark.benchmark(group="kv_pool put")
@pytest.mark.parametrize("sealed", [False, True])
def test_put(benchmark, pool, sealed):
    slot, names = torch.randint(0, 255, (PLAIN,), dtype=torch.uint8), _names()
    if sealed:
        put = lambda: pool.put(next(names), slot)  # noqa: E731
    else:
        put = lambda: pool.client.put(next(names).hex(), 0, pool.sealed_bytes)  # noqa: E731
    assert benchmark.pedantic(put, rounds=ROUNDS, iterations=1, warmup_rounds=5) == "ok"


@pytest.mark.benchmark(group="kv_pool get")
@pytest.mark.parametrize("sealed", [False, True])
def test_get(benchmark, pool, sealed):
    slot, out = torch.randint(0, 255, (PLAIN,), dtype=torch.uint8), torch.empty(PLAIN, dtype=torch.uint8)
    name = os.urandom(32)  # a key of its own (a put under a held key leaves the object as it was)
    assert pool.put(name, slot) == "ok" and pool.client.put(name.hex(), 0, pool.sealed_bytes) == "ok"
    if sealed:
        get = lambda: pool.get(name, out)  # noqa: E731
    else:
        get = lambda: pool.client.get(name.hex(), 0, pool.sealed_bytes)  # noqa: E731
    assert benchmark.pedantic(get, rounds=ROUNDS, iterations=1, warmup_rounds=5) == "ok"
    assert not sealed or torch.equal(out, slot)
