"""What the KV tiers' tests share (engine/kv_tiers.py)."""

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
