"""A KV page as it lives below device memory: one slot of bytes, and the host pool of such slots.

A slot is a header (magic, version, payload size, namespace, the page's chained-hash name, a MAC) and the
page's KV over all layers and TP ranks (rank order, each rank's [layers, planes, heads, page, dim] as the
device cache holds it; an e4m3 cache's bytes, then each rank's scales [layers, planes, heads]). The
namespace says what else must match for the bytes to mean the same KV (model, dtype, layout, page size,
TP shard); the MAC (HMAC-SHA256, keyed by the deployment's secret) covers header and payload, so a slot
read back from a file or the shared pool is used only if it is exactly the page that was saved under that
name, in this namespace, by a holder of the secret. Host slots never leave the process and are not
checked.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import struct
from collections import Counter, OrderedDict, deque

import torch
from torch import Tensor

MAGIC, VERSION = b"PDKV", 1
_FIELDS = struct.Struct("<4sHHQ16s32s")  # magic, version, flags, payload bytes, namespace, name: 64 bytes
MAC_BYTES = 32
HEADER_BYTES = 128  # the fields, the MAC, padding
ALIGN = 4096  # slots are whole file blocks


def namespace(model: str, cache: Tensor, dtype: str, layout: str, tp: int) -> bytes:
    """What else a page's bytes depend on besides its name (16 bytes)."""
    key = f"pdkv|{VERSION}|{model}|{tuple(cache.shape[:1] + cache.shape[2:])}|{dtype}|{layout}|tp={tp}"
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


class PageFormat:
    """Copies pages between the device caches and slots, and stamps and checks slots' headers."""

    def __init__(self, caches: list[Tensor], space: bytes, secret: bytes):
        self.caches, self.space, self.secret = caches, space, secret or b"pdkv"
        self.rank_bytes = [c[:, 0].numel() * c.element_size() for c in caches]
        self.payload = sum(self.rank_bytes)
        self.slot_bytes = -(-(HEADER_BYTES + self.payload) // ALIGN) * ALIGN
        self._streams: dict[str, torch.cuda.Stream] = {}  # on a GPU: "save" (engine thread), "load" (I/O)

    def _ranks(self, slot: Tensor):
        """(device cache, this rank's part of the slot viewed as one page) per rank."""
        at = HEADER_BYTES
        for cache, n in zip(self.caches, self.rank_bytes, strict=True):
            yield cache, slot[at : at + n].view(cache.dtype).view(cache[:, 0].shape)
            at += n

    def save(self, page: int, slot: Tensor) -> None:
        """Device page -> slot's payload (the header is stamped later, off the engine's thread). On a GPU
        on a side stream, after what the compute stream queued (the page's last writes)."""
        with self._stream(after_compute=True):
            for cache, view in self._ranks(slot):
                view.copy_(cache[:, page], non_blocking=cache.is_cuda)

    def load(self, slot: Tensor, page: int) -> None:
        """Slot's payload -> device page (on a GPU on a side stream: no request reads the page before its
        load is done)."""
        with self._stream(after_compute=False):
            for cache, view in self._ranks(slot):
                cache[:, page].copy_(view, non_blocking=cache.is_cuda)

    def load_many(self, memory: Tensor, slots: list[int], pages: list[int]) -> None:
        """The payloads of these slots of memory (the host pool's buffer) -> these device pages, in a few
        batched copies per rank."""
        rows = memory.view(-1, self.slot_bytes).index_select(0, torch.tensor(slots))  # [n, slot bytes]
        with self._stream(after_compute=False):
            at = HEADER_BYTES
            for cache, nbytes in zip(self.caches, self.rank_bytes, strict=True):
                part = rows[:, at : at + nbytes].view(cache.dtype).unflatten(1, cache[:, 0].shape)
                index = torch.tensor(pages, device=cache.device)
                cache.index_copy_(1, index, part.to(cache.device, non_blocking=True).transpose(0, 1))
                at += nbytes

    @contextlib.contextmanager
    def _stream(self, after_compute: bool):
        """Copies on the side stream of the calling thread's role, waited for before returning."""
        if not self.caches[0].is_cuda:
            yield
            return
        key = "save" if after_compute else "load"
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(self.caches[0].device)
        if after_compute:
            stream.wait_stream(torch.cuda.current_stream(self.caches[0].device))
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()

    def _mac(self, fields: bytes, slot: Tensor, key: bytes | None) -> bytes:
        mac = hmac.new(key or self.secret, fields, hashlib.sha256)
        mac.update(memoryview(slot[HEADER_BYTES : HEADER_BYTES + self.payload].numpy()))
        return mac.digest()

    def stamp(self, slot: Tensor, name: bytes, key: bytes | None = None) -> None:
        """Write slot's header for the payload it holds under name (MAC keyed by key, else the secret)."""
        fields = _FIELDS.pack(MAGIC, VERSION, 0, self.payload, self.space, name)
        header = fields + self._mac(fields, slot, key)
        slot[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))

    def check(self, slot: Tensor, name: bytes, key: bytes | None = None) -> str | None:
        """Why slot is not the page name in this namespace (None: it is)."""
        raw = bytes(slot[:HEADER_BYTES].numpy())
        magic, version, _, payload, space, named = _FIELDS.unpack_from(raw)
        if magic != MAGIC or version != VERSION:
            return "not a page slot (magic or version)"
        if payload != self.payload:
            return f"payload of {payload} bytes, expected {self.payload}"
        if space != self.space:
            return "another namespace (model, dtype, layout, page size or TP shard)"
        if named != name:
            return "another page's name"
        mac = raw[_FIELDS.size : _FIELDS.size + MAC_BYTES]
        if not hmac.compare_digest(mac, self._mac(raw[: _FIELDS.size], slot, key)):
            return "checksum (MAC) mismatch"
        for _, view in self._ranks(slot):  # signed but not KV a model makes: recomputed, not served
            flat = view.reshape(-1) if view.element_size() > 1 else view.reshape(-1).float()  # fp8: none
            if flat.is_floating_point() and not torch.isfinite(flat).all():
                return "non-finite values (NaN or inf)"
        return None


class Slots:
    """A tier's index: fixed slots known by name, least recently used first. A busy slot (being read or
    written off the engine's thread) is never handed out again until it is idle; notify(stored?, name)
    hears names come and go (KVTiers' events for the router)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free: deque[int] = deque()
        self._next = 0  # slots from here on were never used
        self._slot: OrderedDict[bytes, int] = OrderedDict()  # name -> slot, least recently used first
        self.busy: Counter[int] = Counter()
        self.num_evicted = 0
        self.notify = None

    def __contains__(self, name: bytes) -> bool:
        return name in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def __iter__(self):
        """The names it holds, least recently used first."""
        return iter(self._slot)

    def get(self, name: bytes) -> int | None:
        slot = self._slot.get(name)
        if slot is not None:
            self._slot.move_to_end(name)
        return slot

    def take(self) -> tuple[int, bytes | None] | None:
        """A slot to fill: a free one, else the least recently used idle one (and the name it dropped);
        None when every slot is busy."""
        if self._free:
            return self._free.popleft(), None
        if self._next < self.num_slots:
            self._next += 1
            return self._next - 1, None
        for name, slot in self._slot.items():
            if not self.busy[slot]:
                del self._slot[name]
                self.num_evicted += 1
                self._tell(False, name)
                return slot, name
        return None

    def put(self, name: bytes, slot: int) -> bool:
        """slot (taken) now holds name; False (and the slot freed) when another slot holds it already."""
        if name in self._slot:
            self._free.append(slot)
            return False
        self._slot[name] = slot
        self._tell(True, name)
        return True

    def give_back(self, slot: int) -> None:
        """A taken slot that was not filled."""
        self._free.append(slot)

    def drop(self, name: bytes) -> None:
        """Forget name (a slot that failed its check is never read again)."""
        slot = self._slot.pop(name, None)
        if slot is not None:
            self._free.append(slot)
            self._tell(False, name)

    def clear(self) -> int:
        """Forget every idle name (busy slots keep theirs until idle); returns how many were dropped."""
        idle = [n for n, s in self._slot.items() if not self.busy[s]]
        for name in idle:
            self.drop(name)
        return len(idle)

    def _tell(self, stored: bool, name: bytes) -> None:
        if self.notify is not None:
            self.notify(stored, name)


class HostPool(Slots):
    """The host tier: the slots of one buffer (pinned when the cache is on a GPU)."""

    def __init__(self, num_slots: int, slot_bytes: int, pin: bool):
        super().__init__(num_slots)
        self.slot_bytes = slot_bytes
        self.memory = torch.empty(num_slots * slot_bytes, dtype=torch.uint8, pin_memory=pin)

    def view(self, slot: int) -> Tensor:
        return self.memory[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]
