"""What the KV tiers' tests share (engine/kv/tiers.py)."""

import threading


def stalled(llm) -> threading.Event:
    """Make llm's tiers' I/O thread block before it copies a loaded page, until the returned event is set
    (a load in flight, for as long as a test needs one)."""
    go, original = threading.Event(), llm.tiers.host.view

    def view(slot):
        if threading.current_thread().name == "kv-tiers-io":
            go.wait(30)
        return original(slot)

    llm.tiers.host.view = view
    return go


def all_busy(llm) -> list[int]:
    """Take every host slot of llm's tiers and mark it busy (as if a write behind each still ran)."""
    host = llm.tiers.host
    held = [host.take()[0] for _ in range(host.num_slots)]
    for slot in held:
        host.busy[slot] += 1
    return held


def release(llm, held: list[int]) -> None:
    """Give back the slots all_busy took, idle and free."""
    for slot in held:
        llm.tiers.host.busy[slot] -= 1
        llm.tiers.host._free.append(slot)
