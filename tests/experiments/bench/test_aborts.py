"""The abort storm (experiments/bench/aborts.py, `make bench-aborts`) made small (a soak all the same: `make
test-all`, 32 s on an AVX2 EPYC; `make test` keeps every exit of every hand-off state, tests/transfer):
1P2D with the tiers on, 40 long prompts whose clients leave at random moments, a decode worker frozen 3 s
halfway. Every request ends, every page on every worker comes back, every request leaves the hand-off, and
a clean batch after gives the greedy texts of before. How many prompt tokens were computed after a client
left is the bench's figure, not held here: a cancel crosses two processes, and on a loaded machine (the
suite's own tests beside it on 2 cores) it took longer than a tiny model's prefill step to arrive (316
tokens once on an AVX2 EPYC); the rule the prefill worker keeps once it hears of it (no pass past the one
in flight) is held event by event in tests/transfer/test_messenger.py."""

import pytest

from experiments.bench import aborts
from experiments.bench.compat import Server
from tests import needs

needs.nixl()


@pytest.mark.slow
def test_a_small_abort_storm_leaves_nothing_behind(short_tmp, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(short_tmp.resolve()))
    deployment, overrides = aborts.DEPLOYMENTS["1p2d"]
    settings = (*overrides, *aborts.SETTINGS, f"model.num_pages={aborts.NUM_PAGES}", "start_timeout_s=600")
    server = Server(deployment, tmp_path, "tiny-random", settings, name="1p2d")
    try:
        r = aborts.storm(server, requests=40, concurrency=8, prompt_words=400, freeze_s=3.0, seed=1)
    finally:
        server.close()
    assert r["ended"] == 40 and set(r["outcomes"]) <= {"left", "finished", "error in stream"}, r
    assert r["pages_free_after_s"] is not None, r  # every page on every worker came back
    assert r["prompt_tokens_after_cancel"] >= 0 and r["cancelled_at_prefill"] >= 0, r  # reported
    assert r["handoff_held_after"] == 0 and r["handoff_ends"], r  # every request left the hand-off
    assert r["texts_identical"], r
