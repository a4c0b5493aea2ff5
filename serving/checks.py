"""The one way a config value is refused: a ValueError naming the key, the value and what is allowed."""

from __future__ import annotations


def refuse(key: str, value, allowed: str) -> None:
    raise ValueError(f"{key}={value!r} is not allowed: {allowed}")


def check_count(key: str, value) -> None:
    """value is an integer >= 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        refuse(key, value, "an integer >= 0")


def check_positive(key: str, value, integer: bool = False) -> None:
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok or not value > 0:
        refuse(key, value, f"must be {'an integer' if integer else 'a number'} > 0")
