"""One side of a NIXL write across two hosts in network namespaces (test_netns.py runs it inside one):

    python -m tests.experiments.netns_peer send|recv FOLDER NBYTES NIC

Each side registers NBYTES of host memory with a NIXL agent whose UCX may use TCP over NIC alone (no shared
memory, no CMA: the bytes must cross the link), writes its metadata to FOLDER/<side>.md and reads the
other's. The sender writes its whole buffer (a known pattern) into the receiver's with the notification
b"done" and records the seconds it took; the receiver waits for the notification and records whether the
bytes arrived intact. Each waits at most 120 s for anything."""

import os
import sys
import time
from pathlib import Path


def _wait(path: Path, give_up: float) -> bytes:
    while not path.exists():
        if time.monotonic() > give_up:
            raise TimeoutError(f"no {path.name}")
        time.sleep(0.01)
    return path.read_bytes()


def main(side: str, folder: str, nbytes: int, nic: str) -> None:
    os.environ.update(UCX_TLS="tcp", UCX_NET_DEVICES=nic)  # the shaped NIC, and nothing else
    import torch

    from transfer.backends.nixl import NixlBackend

    out, give_up = Path(folder), time.monotonic() + 120
    pattern = (torch.arange(nbytes, dtype=torch.int64) % 251).to(torch.uint8)
    buffer = pattern if side == "send" else torch.zeros(nbytes, dtype=torch.uint8)
    agent = NixlBackend(side, devices=nic)
    agent.register([buffer])
    (out / f"{side}.tmp").write_bytes(agent.metadata())
    (out / f"{side}.tmp").replace(out / f"{side}.md")
    peer = agent.connect(_wait(out / ("recv.md" if side == "send" else "send.md"), give_up))
    if side == "send":
        start = time.perf_counter()
        handle = agent.post(peer, [(0, 0, 0, 0, nbytes)], b"done")
        while (state := agent.state(handle)) == "PROC":
            if time.monotonic() > give_up:
                raise TimeoutError("the write did not finish")
        seconds = time.perf_counter() - start
        agent.release(handle)
        (out / "send.result").write_text(f"{state} {seconds:.4f}")
        _wait(out / "recv.result", give_up)  # the receiver has it: the agent may go
    else:
        while not any(msg == b"done" for _, msg in agent.notifications()):
            if time.monotonic() > give_up:
                raise TimeoutError("no notification")
            time.sleep(0.001)
        (out / "recv.result").write_text("intact" if torch.equal(buffer, pattern) else "corrupted")
    agent.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
