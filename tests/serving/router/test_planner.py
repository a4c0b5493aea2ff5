"""Elastic roles (serving/router/planner.py): the planner's moves on a driven clock, scripted
switches, and its config's checks."""

import re

import pytest

from serving.router.belief import Speed
from serving.router.planner import Planner, PlannerConfig
from serving.router.policy import Router


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _planner(clock, **config):
    return Planner(PlannerConfig(**{"enabled": True, "interval_s": 1.0, **config}), (1.0, 0.1), clock)


ROLES = {"p0": "prefill", "d0": "decode", "d1": "decode"}


def test_the_planner_moves_a_decode_worker_to_prefill_when_ttft_misses_and_tpot_has_room():
    clock = _Clock()
    planner = _planner(clock)
    router = Router(["d0", "d1"], prefill_workers=["p0"])
    router.route("busy", [("x", 0)], 16, ["d0"])  # d0 has a request: d1 is the one to move
    for _ in range(5):
        planner.observe(3.0, 0.02)  # TTFT 3x its SLO, TPOT a fifth of it
    clock.t += 1.0
    assert planner.decide(ROLES, router) is None  # patience: the first look only counts
    clock.t += 1.0
    assert planner.decide(ROLES, router) == ("d1", "prefill")
    assert "TTFT at 3.00x" in planner.why
    clock.t += 1.0
    assert planner.decide(ROLES, router) is None  # quiet after a move (hysteresis)


def test_the_planner_moves_a_prefill_worker_to_decode_when_tpot_misses():
    clock = _Clock()
    planner = _planner(clock, patience=1)
    roles = {"p0": "prefill", "p1": "prefill", "d0": "decode"}
    for _ in range(5):
        planner.observe(0.1, 0.3)
    clock.t += 1.0
    assert planner.decide(roles) == ("p0", "decode")


@pytest.mark.parametrize(
    "ttft, tpot, roles, why",
    [
        (3.0, 0.02, {"p0": "prefill", "d0": "decode"}, "the last decode worker stays (min_decode)"),
        (3.0, 0.08, ROLES, "both roles are loaded: nothing to give"),
        (0.5, 0.05, ROLES, "both meet the SLO"),
        (None, None, ROLES, "nothing measured yet"),
    ],
)
def test_the_planner_holds_still(ttft, tpot, roles, why):
    clock = _Clock()
    planner = _planner(clock, patience=1)
    if ttft is not None:
        planner.observe(ttft, tpot)
    for _ in range(3):
        clock.t += 1.0
        assert planner.decide(roles) is None, why


def test_the_planner_forgets_what_left_its_window_and_waits_out_a_move_in_progress():
    clock = _Clock()
    planner = _planner(clock, patience=1, window_s=5.0)
    planner.observe(3.0, 0.02)
    clock.t += 6.0  # the slow request is older than the window
    assert planner.decide(ROLES) is None
    planner.observe(3.0, 0.02)
    clock.t += 1.0
    assert planner.decide(ROLES, busy=True) is None  # one move at a time
    clock.t += 1.0
    assert planner.decide(ROLES) == ("d0", "prefill")


def test_the_router_s_prefill_queue_counts_as_ttft_pressure_before_any_request_finishes():
    clock = _Clock()
    planner = _planner(clock, patience=1)
    router = Router(["d0", "d1"], prefill_workers=["p0"], clock=clock)
    router.speed["p0"] = Speed(prefill_tok_s=100.0)
    router.prefill_live.add("p0")
    router.route_tokens("long", list(range(500)), ["d0"], admit=True)  # 5 s of prompt ahead at p0
    planner.observe(None, 0.01)
    clock.t += 1.0
    assert planner.pressures(router)[0] == pytest.approx(5.0)
    assert planner.decide(ROLES, router) == ("d1", "prefill")


def test_scripted_switches_run_at_their_times_planner_or_not():
    clock = _Clock()
    planner = Planner(PlannerConfig(switches=[[2, "d1", "prefill"], [1, "p0", "decode"]]), (1.0, 0.1), clock)
    clock.t += 0.5
    assert not planner.due() and planner.decide(ROLES) is None
    clock.t += 1.0
    assert planner.due()  # the first scripted move's time: the callers gather the roles now
    assert planner.decide(ROLES) == ("p0", "decode") and planner.why == "scripted"
    clock.t += 1.0
    assert planner.decide(ROLES, busy=True) is None  # the next waits for the move under way
    assert planner.decide(ROLES) == ("d1", "prefill")
    assert planner.decide({"d1": "prefill"}) is None  # nothing left, and the planner itself is off


@pytest.mark.parametrize(
    "config, message",
    [
        ({"enabled": "yes"}, "deployment.planner.enabled='yes' is not allowed: true or false"),
        ({"interval_s": 0}, "deployment.planner.interval_s=0 is not allowed: a number of seconds > 0"),
        ({"min_decode": 0}, "deployment.planner.min_decode=0 is not allowed: an integer >= 1"),
        ({"headroom": 2}, "deployment.planner.headroom=2 is not allowed: a number in (0, 1]"),
        ({"switches": [[1, "d0"]]}, "deployment.planner.switches: [1, 'd0'] is not allowed"),
        ({"switches": [[-1, "d0", "prefill"]]}, "worker, role], role one of prefill, decode"),
        ({"switches": [[1, "d0", "colocated"]]}, "is not allowed"),
    ],
)
def test_bad_planner_configs_name_the_field(config, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PlannerConfig(**config)


def test_a_deployment_s_planner_is_checked_against_its_workers():
    from serving.config import DeploymentConfig

    d = DeploymentConfig("e", "disaggregated", num_prefill=1, num_decode=2, planner={"enabled": True})
    assert d.elastic and isinstance(d.planner, PlannerConfig)
    assert not DeploymentConfig("f", "disaggregated", num_prefill=1, num_decode=1).elastic
    with pytest.raises(ValueError, match=r"a worker of this deployment: \['prefill-0', 'decode-0'\]"):
        DeploymentConfig(
            "e",
            "disaggregated",
            num_prefill=1,
            num_decode=1,
            planner={"switches": [[1, "decode-3", "prefill"]]},
        )
    with pytest.raises(ValueError, match="elastic roles need kind=disaggregated"):
        DeploymentConfig("c", "colocated", planner={"enabled": True})
