"""The router's choice of a disaggregated request's prefill worker, priced by what that worker lacks."""

from serving.router.policy import Router
from tests.serving.router.test_policy import _Load


def test_a_prefill_worker_is_priced_by_what_it_lacks_not_by_what_the_decode_worker_holds():
    """A follow-up turn whose history the decode worker holds still costs its whole prompt on a prefill
    worker that has not seen it (the prefill computes what it lacks): in the conversation trace at 3x its
    rate, admission priced it at the decode worker's miss and let in requests that then missed the TTFT
    SLO (docs/results/reproduction.md). The prefill worker that computed the history is chosen for the next
    turn, at what it lacks."""
    now = [0.0]
    r = Router(["d0"], admission="slo", slo=(1.0, 1.0), prefill_workers=["p0", "p1"], page_size=16,
               clock=lambda: now[0])  # fmt: skip
    r.observe_load("p0", _Load(1000, 1.0))
    r.observe_load("p1", _Load(1000, 1.0))
    history = [f"h{i}" for i in range(50)]  # 800 tokens
    assert r.route("t1", history, 800, ["d0"], admit=True) == "d0"
    first = r.prefill_of("t1")
    assert r.waiting["t1"][1] == 800
    r.first_token("t1")
    r.finished("d0", "t1", history)  # the decode worker holds the history now
    turn = [*history, *(f"n{i}" for i in range(10))]  # 960 tokens, 160 new
    assert r.route("t2", turn, 960, ["d0"], admit=True) == "d0"
    assert r.prefill_of("t2") == first and r.waiting["t2"][1] == 160  # where the history was computed
    r.first_token("t2")
    r.forget(first)  # that worker restarted: its cache is gone, and every prefill worker lacks the turn
    r.observe_load(first, _Load(1000, 1.0))
    assert r.route("t3", [*turn, "x"], 976, ["d0"], admit=True) == "d0"
    assert r.waiting["t3"][1] == 976  # priced whole, though the decode worker holds 960 of its tokens
