"""Both transfer engines carry planned page writes byte for byte; NIXL between two real processes."""

import multiprocessing as mp
import time

import pytest
import torch

from transfer.backends import TransferError, WriteOp, make_backend
from transfer.plan import ShardSpec, plan_writes

GEOMETRY = dict(num_kv_heads=4, num_layers=3, num_pages=8, page_size=16, head_dim=64, itemsize=1)
SRC, DST = ShardSpec(tp=2, **GEOMETRY), ShardSpec(tp=1, **GEOMETRY)  # prefill TP 2 -> decode TP 1
SRC_PAGES, DST_PAGES = [5, 1, 7], [0, 6, 2]


def _source_regions():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (SRC.region_bytes,), generator=g, dtype=torch.uint8) for _ in range(SRC.tp)]


def _posts():
    """One post per layer, as the messenger streams them: (ops, notification)."""
    posts = []
    for layer in range(GEOMETRY["num_layers"]):
        writes = plan_writes(SRC, DST, SRC_PAGES, DST_PAGES, layers=range(layer, layer + 1))
        posts.append(
            (
                [WriteOp(w.src_rank, w.src_offset, w.dst_rank, w.dst_offset, w.nbytes) for w in writes],
                f"req-0:{layer}".encode(),
            )
        )
    return posts


def _expected_destination():
    """What decode rank 0 must hold: both source ranks' heads of each page, in the destination pages."""
    view = torch.zeros(DST.region_bytes, dtype=torch.uint8).view(DST.num_layers, DST.num_pages, 2, 4, -1)
    for rank, region in enumerate(_source_regions()):
        src = region.view(SRC.num_layers, SRC.num_pages, 2, 2, -1)
        view[:, DST_PAGES, :, 2 * rank : 2 * rank + 2] = src[:, SRC_PAGES]
    return view.reshape(-1)


def _send_all(backend, peer):
    handles = [backend.post(peer, ops, notif) for ops, notif in _posts()]
    deadline = time.monotonic() + 30
    while any(backend.state(h) == "PROC" for h in handles):
        assert time.monotonic() < deadline, "writes did not finish in 30 s"
    assert [backend.state(h) for h in handles] == ["DONE"] * len(handles)
    for h in handles:
        backend.release(h)


def test_local_backend_carries_planned_writes():
    prefill, decode = make_backend("local", "p-local"), make_backend("local", "d-local")
    try:
        prefill.register(_source_regions())
        region = torch.zeros(DST.region_bytes, dtype=torch.uint8)
        decode.register([region])
        _send_all(prefill, prefill.connect(decode.metadata()))
        assert torch.equal(region, _expected_destination())
        assert [m for _, m in decode.notifications()] == [n for _, n in _posts()]
        with pytest.raises(TransferError, match="outside its registered regions"):
            prefill.post("d-local", [WriteOp(0, 0, 0, DST.region_bytes - 1, 2)], b"")
        with pytest.raises(TransferError, match="not connected"):
            prefill.post("nobody", [], b"")
    finally:
        prefill.close()
        decode.close()


def _nixl_decode_side(to_prefill, from_prefill):
    """The target process: register a KV region, publish metadata, wait for every layer's notification."""
    backend = make_backend("nixl", "decode-0")
    region = torch.zeros(DST.region_bytes, dtype=torch.uint8)
    backend.register([region])
    to_prefill.put(backend.metadata())
    notes, deadline = [], time.monotonic() + 30
    while len(notes) < GEOMETRY["num_layers"] and time.monotonic() < deadline:
        notes += [m for _, m in backend.notifications()]
    to_prefill.put((notes, region.numpy().tobytes()))
    from_prefill.get(timeout=30)  # stay up until the initiator has checked its handles
    backend.close()


def test_nixl_between_two_processes():
    pytest.importorskip("nixl_cu12")
    ctx = mp.get_context("spawn")
    to_prefill, from_prefill = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_nixl_decode_side, args=(to_prefill, from_prefill))
    proc.start()
    try:
        prefill = make_backend("nixl", "prefill-0")
        prefill.register(_source_regions())  # the backend keeps the tensors alive
        peer = prefill.connect(to_prefill.get(timeout=60))
        assert peer == "decode-0"
        _send_all(prefill, peer)
        notes, data = to_prefill.get(timeout=60)
        assert sorted(notes) == sorted(n for _, n in _posts())
        assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.uint8), _expected_destination())
        from_prefill.put("done")
        prefill.close()
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


def test_backend_names_are_checked():
    with pytest.raises(ValueError, match="transfer backend must be one of"):
        make_backend("sockets", "x")
    pytest.importorskip("nixl_cu12")
    with pytest.raises(ValueError, match="NIXL engine must be one of"):
        make_backend("nixl", "x", engine="TCP")


@pytest.mark.parametrize(
    "devices, expected",
    [
        ("lo", {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib"}),  # loopback: no IB (its exit crash)
        ("mlx5_0:1", {"UCX_NET_DEVICES": "mlx5_0:1"}),  # InfiniBand stays on for a real device
        ("mlx5_0:1,eth0", {"UCX_NET_DEVICES": "mlx5_0:1,eth0"}),
        ("all", {}),
    ],
)
def test_ucx_modules_are_left_alone_unless_the_devices_are_loopback_only(devices, expected):
    from transfer.backends.nixl import ucx_environment

    assert ucx_environment(devices) == expected


def test_importing_the_nixl_backend_sets_no_ucx_variable():
    """Importing used to set UCX_MODULES=^ib for every user (InfiniBand off for nixl_devices=mlx5_0:1)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    code = "import os, transfer.backends.nixl; print(sorted(k for k in os.environ if k.startswith('UCX_')))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_an_agent_on_a_nic_that_is_not_there_fails_naming_it():
    """Each agent may have its own NIC (a DP rank's: transfer.nics_per_rank, NIXL's UCX device_list);
    one that is no device here fails at once, saying which, and the process's other agents still work."""
    pytest.importorskip("nixl_cu12")
    with pytest.raises(TransferError, match=r"NIC 'mlx5_9:1' \(transfer.nics_per_rank\)"):
        make_backend("nixl", "no-such-nic", devices="lo", nic="mlx5_9:1")
    make_backend("nixl", "loopback-after-it", devices="lo").close()
