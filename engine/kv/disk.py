"""The disk tier: page slots in one file of an engine's own folder, moved by NIXL's POSIX backend.

The folder holds `pages` (the slots, preallocated: a disk too small fails at start, with one warning,
not mid-run, and the space is checked first and given back when that fails), `index` (one line "slot
name" per page written, replayed at start so that a restarted worker starts warm; the slot's own header
and MAC are the truth, the index only a hint), `namespace` (the index is dropped when it differs) and
`lock` (one engine per folder). The key its slots' MACs are keyed with is not there: whoever can write
the folder could re-sign forged pages with it. It lives in a private folder of this user's
(`$XDG_STATE_HOME/pdkernels/kv-disk-keys`, else `~/.local/state/...`, 0700), one file per disk folder,
made once (pages outlive a deployment's secret). The folder must be this user's own and closed to
others (made 0700 when new; refused otherwise), and no file in it is opened through a symlink. A file
transfer that fails turns the tier off with one warning; what it was loading is recomputed.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import stat
import time
from collections import OrderedDict, deque

from torch import Tensor

from engine.kv.pages import Slots
from transfer.backends.base import TransferError
from transfer.backends.files import NixlFiles, open_nofollow

log = logging.getLogger(__name__)


def private_folder(path: str, what: str) -> None:
    """Make path (0700) or check that it is a folder of this user's that no one else can enter: a
    ValueError naming `what` otherwise."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return private_folder(path, what)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{what}={path!r} is not a folder (a symlink or a file): give a folder of its own")
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ValueError(
            f"{what}={path!r} belongs to uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}: it must "
            f"be this user's (uid {os.geteuid()}) and closed to others (chmod 700), or name a new folder"
        )


def key_folder() -> str:
    """Where disk folders' MAC keys live: this user's state folder, outside every disk folder."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "pdkernels", "kv-disk-keys")


def _key(folder: str) -> bytes:
    """The disk folder's MAC key: 32 random bytes, made on first use in key_folder(), readable by this
    user only."""
    keys = key_folder()
    private_folder(keys, "the disk tier's key folder (XDG_STATE_HOME)")
    path = os.path.join(keys, hashlib.sha256(os.path.realpath(folder).encode()).hexdigest()[:32])
    try:
        fd = open_nofollow(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        with os.fdopen(open_nofollow(path, os.O_RDONLY), "rb") as f:
            key = f.read(33)
        if len(key) == 32:
            return key
        os.unlink(path)  # cut short: a new key (the slots it keyed fail their check and are recomputed)
        return _key(folder)
    key = os.urandom(32)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key


def _read(path: str) -> str:
    with os.fdopen(open_nofollow(path, os.O_RDONLY), "r", errors="replace") as f:
        return f.read()


class DiskTier(Slots):
    """The disk tier's index (Slots) over its file; off for good after a failure (fail)."""

    def __init__(self, folder: str, num_slots: int, slot_bytes: int, space: bytes, memory: Tensor):
        """memory: the host pool's buffer (slots move between it and the file). Raises ValueError when
        another engine holds the folder and OSError when the folder or file cannot be made."""
        private_folder(folder, "kv_tiers.disk_dir")
        self.folder = folder
        self._lock = os.fdopen(open_nofollow(os.path.join(folder, "lock"), os.O_RDWR | os.O_CREAT), "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise ValueError(
                f"kv_tiers.disk_dir={folder!r} is in use by another engine: give each its own"
            ) from None
        try:  # first, so that a disk too small for disk_bytes fails here
            self.files = NixlFiles(os.path.join(folder, "pages"), num_slots, slot_bytes, memory)
        except Exception:
            self._lock.close()
            raise
        super().__init__(num_slots)
        self.alive = True
        try:
            self.key = _key(folder)
            if os.path.lexists(old := os.path.join(folder, "key")):  # where earlier versions kept it
                os.unlink(old)
            self._replay(space)
        except Exception:
            self.files.close()
            self._lock.close()
            raise
        used = set(self._slot.values())
        self._next = max(used, default=-1) + 1  # slots from here on were never written
        self._free = deque(s for s in range(self._next) if s not in used)

    def _replay(self, space: bytes) -> None:
        """Names from the index of an earlier run in this namespace (later lines win); rewrite it compact."""
        ns_path, index_path = os.path.join(self.folder, "namespace"), os.path.join(self.folder, "index")
        same = os.path.lexists(ns_path) and _read(ns_path).strip() == space.hex()
        if same and os.path.lexists(index_path):
            by_slot: dict[int, bytes] = {}
            for line in _read(index_path).splitlines():
                parts = line.split()
                try:
                    slot, name = int(parts[0]), bytes.fromhex(parts[1])
                except (IndexError, ValueError):
                    continue  # a line cut short by a kill
                if 0 <= slot < self.num_slots and len(name) == 32:
                    by_slot[slot] = name
            for slot, name in by_slot.items():
                self._slot.pop(name, None)
                self._slot[name] = slot
            self._slot = OrderedDict((n, s) for n, s in self._slot.items() if by_slot.get(s) == n)
        with os.fdopen(open_nofollow(ns_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as f:
            f.write(space.hex())
        self._index = os.fdopen(open_nofollow(index_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w")
        self._index.writelines(f"{s} {n.hex()}\n" for n, s in self._slot.items())
        self._index.flush()  # appended to while the tier lives

    def __contains__(self, name: bytes) -> bool:
        return self.alive and super().__contains__(name)

    def get(self, name: bytes) -> int | None:
        return super().get(name) if self.alive else None

    def take(self) -> tuple[int, bytes | None] | None:
        """A slot to write (Slots.take); None when the tier is off or every slot is busy."""
        return super().take() if self.alive else None

    def written(self, name: bytes, slot: int, ok: bool) -> None:
        """A write into slot (taken) ended: a page of the tier from now on, in the index too."""
        if not ok:
            self.give_back(slot)
        elif self.put(name, slot):
            self._index.write(f"{slot} {name.hex()}\n")
            self._index.flush()

    def fail(self, why: str) -> None:
        """Turn the tier off (once, with a warning): its pages become misses."""
        if self.alive:
            log.warning("the disk tier in %s is off from now on: %s", self.folder, why)
            self.alive = False

    def move(self, op: str, pairs: list[tuple[int, int]], nbytes: int, deadline: float) -> str:
        """Run a READ (file -> host slots) or WRITE of (host offset, file slot) pairs, off the engine's
        thread: 'DONE', 'ERR', or 'STUCK' (past the deadline, time.monotonic(): the tier turns off and
        the host slots must stay busy, since the transfer may still land in them)."""
        try:
            handle = self.files.start(op, pairs, nbytes)
        except TransferError as e:
            self.fail(f"a {op} failed: {e}")
            return "ERR"
        while (state := self.files.state(handle)) == "PROC":
            if time.monotonic() > deadline:
                self.fail(f"a {op} of {len(pairs)} pages passed its deadline")
                return "STUCK"  # its handle is left alone: releasing it mid-flight is not safe
            time.sleep(0.0002)
        self.files.release(handle)
        if state != "DONE":
            self.fail(f"a {op} of {len(pairs)} pages failed ({state})")
            return "ERR"
        return "DONE"

    def close(self) -> None:
        self.files.close()
        self._index.close()
        self._lock.close()
