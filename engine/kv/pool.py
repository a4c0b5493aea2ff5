"""The shared tier: pages in a pool every worker of a deployment reads and writes (Mooncake Store,
transfer/backends/mooncake.py). A page's key is derived from its namespace and chained-hash name, so any
worker with the same model, dtype, layout, page size and TP finds what any other computed, and a restarted
worker starts warm. Which names the pool holds is remembered for a second, so that a request waiting for
room does not ask again every step.

Mooncake authenticates no one: any process on a host that reaches the master can list the pool's keys,
read any object, remove them all or write its own. So nothing in it is readable or usable without the
deployment's secret: a key is an HMAC of the page's name (no one else can tell which prompts are cached,
salted or not), and an object is its slot sealed with AES-GCM under a key derived from the secret, bound
to its pool key (read, it is noise; copied under another key or forged, it fails to open and the page is
computed). The slot inside still carries its MAC and header (engine/kv/pages.py), checked as from any
tier. An object that fails is replaced by the next put of its page. What an intruder can still do is
remove or crowd out objects: pages are then computed again (a miss, never wrong text).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time

import numpy as np
import torch
from torch import Tensor

KNOWN_S = 1.0  # how long an answer of the pool's about a name is trusted
KNOWN_MAX = 50_000
NONCE, TAG = 12, 16  # AES-GCM's: a random nonce a put (2**-32 collision odds at 2**32 puts of one key)
SEALS = 2  # sealed objects in the client's buffer: a call past its deadline keeps its own till it returns


class PoolTier:
    def __init__(self, master: str, metadata: str, space: bytes, secret: bytes, plain_bytes: int,
                 deadline_s: float, lookup_s: float):  # fmt: skip
        """plain_bytes: how much of a slot an object holds (header and payload, not the padding)."""
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        from transfer.backends.mooncake import StoreClient

        self.plain_bytes = plain_bytes
        self.sealed_bytes = NONCE + plain_bytes + TAG
        self._stride = -(-self.sealed_bytes // 4096) * 4096
        self.memory = torch.empty(SEALS * self._stride, dtype=torch.uint8)  # registered: outlives the client
        self.client = StoreClient(master, metadata, self.memory, deadline_s, lookup_s)
        self._free, self._held = list(range(SEALS)), []  # _held: given to a call past its deadline
        self._aead = AESGCM(hmac.new(secret, b"pdkernels kv pool: seal", hashlib.sha256).digest())
        self._names = hmac.new(secret, b"pdkernels kv pool: names|" + space, hashlib.sha256)
        self._known: dict[bytes, tuple[bool, float]] = {}  # name -> (held?, when asked)
        # names whose object failed its check here: the next put of the page replaces it (else a bad or
        # short object under a key kept that prefix out of the pool for good: puts skip held keys)
        self.rejected: dict[bytes, float] = {}  # name -> when its removal may be tried (monotonic)
        self.puts = 0  # pages this worker put

    def key(self, name: bytes) -> str:
        """The pool's key for a page: an HMAC of its namespace and name under the deployment's secret."""
        mac = self._names.copy()
        mac.update(name)
        return "pdkv/" + mac.hexdigest()[:40]

    def put(self, name: bytes, slot: Tensor) -> str:
        """A host slot sealed into the pool under name's key: 'ok', 'failed' or 'late'."""
        seal = self._take()
        if seal is None:
            return "failed"
        key, nonce, at = self.key(name), os.urandom(NONCE), seal * self._stride
        sealed = self.memory[at : at + self.sealed_bytes].numpy()
        sealed[:NONCE] = np.frombuffer(nonce, dtype=np.uint8)
        self._aead.encrypt_into(nonce, slot[: self.plain_bytes].numpy(), key.encode(), sealed[NONCE:])
        return self._give(seal, self.client.put(key, at, self.sealed_bytes))

    def offer(self, name: bytes, slot: Tensor, stamp) -> str:
        """Put name's page (a host slot, stamp(slot, name) writing its header first) unless the pool holds
        it: 'held' (another worker's: an RPC is cheaper than a page), 'leased' (a rejected object under
        its key that a read still leases: not replaced yet), else put's state."""
        key = self.key(name)
        if name in self.rejected:  # a bad object under this key: this page replaces it
            if self.client.remove(key) != "ok":  # a read's lease on it, or the store is down
                return "leased"
            self.rejected.pop(name, None)
        if self.client.exists([key])[0]:
            return "held"
        stamp(slot, name)
        return self.put(name, slot)

    def get(self, name: bytes, slot: Tensor) -> str:
        """name's object opened into a slot: 'ok', 'miss' (none, or another size), 'failed', 'late', or
        'unsealed' (not sealed under this key with this deployment's secret: forged, moved or garbage)."""
        from cryptography.exceptions import InvalidTag

        seal = self._take()
        if seal is None:
            return "failed"
        key, at = self.key(name), seal * self._stride
        got = self.client.get(key, at, self.sealed_bytes)
        if got == "ok":
            sealed = self.memory[at : at + self.sealed_bytes].numpy()
            try:
                nonce = sealed[:NONCE].tobytes()
                self._aead.decrypt_into(nonce, sealed[NONCE:], key.encode(), slot[: self.plain_bytes].numpy())
            except InvalidTag:
                got = "unsealed"
        return self._give(seal, got)

    def _take(self) -> int | None:
        """A free part of the buffer (None while every one is held by a call past its deadline)."""
        if self._held and self.client.settled():
            self._free += self._held
            self._held.clear()
        return self._free.pop() if self._free else None

    def _give(self, seal: int, state: str) -> str:
        (self._held if state == "late" else self._free).append(seal)
        return state

    def find(self, names: list[bytes]) -> int:
        """How many leading names the pool holds (0 while it is down)."""
        now, ask = time.monotonic(), []
        for name in names:
            held = self._known.get(name)
            if held is None or now - held[1] > KNOWN_S:
                ask.append(name)
        if ask and self.client.up:
            if len(self._known) > KNOWN_MAX:
                self._known.clear()
            for name, held in zip(ask, self.client.exists([self.key(n) for n in ask]), strict=True):
                self._known[name] = (held, now)
        found = 0
        for name in names:
            held = self._known.get(name)
            if not self.client.up or held is None or not held[0]:
                break
            found += 1
        return found

    def holds(self, name: bytes) -> bool:
        """Known to be in the pool, however long ago (a put of it would most likely be wasted)."""
        held = self._known.get(name)
        return held is not None and held[0]

    def stored(self, name: bytes) -> None:
        self._known[name] = (True, time.monotonic())

    def forget(self, name: bytes) -> None:
        self._known.pop(name, None)

    def reject(self, name: bytes) -> None:
        """name's object failed its check: not known to be held, and replaced when next put."""
        self.forget(name)
        if len(self.rejected) > KNOWN_MAX:
            self.rejected.clear()
        self.rejected[name] = 0.0

    def close(self) -> None:
        self.client.close()
