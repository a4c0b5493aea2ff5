"""Waiting for an event in a test: a ceiling that only ends a hang, never a speed check."""

import time


def until(done, what: str = "the state", within_s: float = 30.0, every_s: float = 0.02) -> None:
    """Call done() until it is true; fail naming what was awaited once within_s has passed."""
    give_up = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < give_up, f"still waiting for {what}"
        time.sleep(every_s)
