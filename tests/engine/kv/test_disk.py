"""The disk tier against whoever else can reach its folder (engine/kv/disk.py, transfer/backends/files.py):
its MAC key is kept outside the folder, a folder others can enter is refused, no file is opened through a
symlink, a disk too small takes nothing, and a signed page of NaNs is recomputed rather than served."""

import logging
import os
import stat
import subprocess

import pytest
import torch

from engine import LLM
from engine.kv.disk import key_folder
from engine.kv.pages import PageFormat, namespace
from tests import needs
from tests.engine.kv.test_tiers import GREEDY, SMALL, _one_by_one, _prompts

needs.nixl()  # the disk tier moves its files through NIXL POSIX


def _tiers(folder):
    return {"host_bytes": 256 << 10, "disk_bytes": 8 << 20, "disk_dir": str(folder)}


@pytest.fixture(scope="module")
def reference():
    llm = LLM("tiny-random", enable_prefix_caching=False, **SMALL)
    return [o.token_ids for o in _one_by_one(llm, _prompts()[4:])]


def _rewrite_pages(folder, fmt, key, payload):
    """Every slot the index names: its payload set by payload(view) and signed again with key (an
    attacker who can write the folder and knows that key)."""
    size = fmt.slot_bytes
    with open(folder / "pages", "r+b") as f:
        for line in (folder / "index").read_text().splitlines():
            slot, name = int(line.split()[0]), bytes.fromhex(line.split()[1])
            f.seek(slot * size)
            view = torch.frombuffer(bytearray(f.read(size)), dtype=torch.uint8)
            for _, part in fmt._ranks(view):
                part.copy_(payload(part))
            fmt.stamp(view, name, key)
            f.seek(slot * size)
            f.write(view.numpy().tobytes())


def _pages_then_again(folder, reference, caplog, forge, why: str) -> None:
    """Pages written by one engine, then forge(fmt, key) run on its folder, then another engine: its
    replies are the computed ones, and it dropped pages saying why."""
    llm = LLM("tiny-random", **SMALL, kv_tiers=_tiers(folder))
    _one_by_one(llm, _prompts()[:4])
    fmt, key = llm.tiers.fmt, llm.tiers.disk.key
    llm.close()
    forge(fmt, key)
    again = LLM("tiny-random", **SMALL, kv_tiers=_tiers(folder))
    with caplog.at_level(logging.WARNING, logger="engine.kv.tiers"):
        outs = _one_by_one(again, _prompts()[4:])
    assert [o.token_ids for o in outs] == reference
    assert again.kv_tier_stats["disk"]["dropped"] > 0 and why in caplog.text
    again.close()


def test_pages_signed_with_a_key_planted_in_the_folder_are_recomputed(reference, tmp_path, caplog):
    """The folder keeps no key (earlier versions kept `key` there, so anyone who could write the folder
    re-signed forged pages: 200s with wrong text); a key planted there signs nothing we accept."""
    folder = tmp_path / "kv"
    planted = bytes(range(32))

    def forge(fmt, key):
        assert not (folder / "key").exists()
        keys = [os.path.join(key_folder(), k) for k in os.listdir(key_folder())]
        assert keys and all(stat.S_IMODE(os.stat(k).st_mode) == 0o600 for k in keys)
        assert stat.S_IMODE(os.stat(key_folder()).st_mode) == 0o700
        (folder / "key").write_bytes(planted)
        _rewrite_pages(folder, fmt, planted, lambda part: torch.randn_like(part) * 4)

    _pages_then_again(folder, reference, caplog, forge, "MAC")


def test_signed_pages_of_nans_are_recomputed_not_served(reference, tmp_path, caplog):
    """A page whose MAC is right but whose values are not finite (a bug, or a leaked key) is dropped
    like a corrupted one: greedy text as computed, not empty text."""
    folder = tmp_path / "kv"
    nans = lambda fmt, key: _rewrite_pages(folder, fmt, key, lambda part: torch.full_like(part, float("nan")))
    _pages_then_again(folder, reference, caplog, nans, "non-finite")


def test_a_page_format_check_names_non_finite_values():
    cache = torch.randn(2, 4, 2, 2, 4, 8)
    fmt = PageFormat([cache], namespace("m", cache, "float32", "HND", 1), b"secret")
    slot, name = torch.zeros(fmt.slot_bytes, dtype=torch.uint8), bytes(range(32))
    cache[0, 1, 0, 0, 0, 0] = float("inf")
    fmt.save(1, slot)
    fmt.stamp(slot, name)
    assert fmt.check(slot, name) == "non-finite values (NaN or inf)"
    fmt.save(2, slot)
    fmt.stamp(slot, name)
    assert fmt.check(slot, name) is None


@pytest.mark.parametrize("mode", [0o777, 0o750])
def test_a_folder_others_can_enter_is_refused_naming_the_field(tmp_path, mode):
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(ValueError, match=r"kv_tiers.disk_dir=.*closed to others \(chmod 700\)"):
        LLM("tiny-random", **SMALL, kv_tiers=_tiers(folder))
    assert sorted(os.listdir(folder)) == []  # nothing was written into it


def test_a_symlinked_folder_is_refused(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ValueError, match=r"kv_tiers.disk_dir=.* is not a folder \(a symlink"):
        LLM("tiny-random", **SMALL, kv_tiers=_tiers(tmp_path / "link"))


def test_a_new_folder_is_made_private(tmp_path):
    folder = tmp_path / "a" / "b"
    LLM("tiny-random", **SMALL, kv_tiers=_tiers(folder)).close()
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700


@pytest.mark.parametrize("name", ["pages", "index", "namespace", "lock"])
def test_a_file_replaced_by_a_symlink_is_not_followed(tmp_path, caplog, name):
    """`pages` (or another file) turned into a link to a file elsewhere: that file is neither grown nor
    written; the engine serves without the disk tier, and says why."""
    folder = tmp_path / "kv"
    LLM("tiny-random", **SMALL, kv_tiers=_tiers(folder)).close()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (folder / name).unlink()
    (folder / name).symlink_to(victim)
    with caplog.at_level(logging.WARNING, logger="engine.kv.tiers"):
        llm = LLM("tiny-random", **SMALL, kv_tiers=_tiers(folder))
    assert llm.tiers.disk is None and "Too many levels of symbolic links" in caplog.text
    assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
    llm.close()
    assert victim.read_bytes() == b"precious"


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs of the test's own (root only), unmounted after."""
    mount = tmp_path / "small"
    mount.mkdir()
    mount_it = ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)]
    if os.geteuid() != 0 or subprocess.run(mount_it).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_disk_tier_larger_than_the_free_space_takes_none_of_it(small_fs, caplog):
    """disk_bytes over the file system's free space: one warning, no disk tier, and the space is all
    still free (a preallocation that failed part way kept 267 of 272 MB, even after the engine stopped)."""
    before = os.statvfs(small_fs)
    tiers = {"host_bytes": 256 << 10, "disk_bytes": 16 << 20, "disk_dir": str(small_fs / "kv")}
    with caplog.at_level(logging.WARNING, logger="engine.kv.tiers"):
        llm = LLM("tiny-random", **SMALL, kv_tiers=tiers)
    assert llm.tiers.disk is None and caplog.text.count("no disk tier") == 1
    assert "free" in caplog.text
    after = os.statvfs(small_fs)
    assert after.f_bfree * after.f_frsize >= before.f_bfree * before.f_frsize - (64 << 10)
    llm.close()
