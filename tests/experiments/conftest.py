"""Fixtures the end-to-end server tests share."""

import pytest


@pytest.fixture(scope="module")
def reference():
    """In-process greedy reference outputs for tiny-random, with the server's cache geometry."""
    from engine import LLM

    return LLM("tiny-random", page_size=4, num_pages=256)
