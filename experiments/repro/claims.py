"""One reproduced claim of the seeds: what it says, its figure, ours, and how ours was obtained.

A claim's figure is bounded one of three ways: `about` (a value: reproduced within TOLERANCE), `above` or
`below` (a bound: reproduced when ours is on its side, within TOLERANCE), or `range` (reproduced inside
[paper, paper_hi]). The error is ours against the figure (against the nearer end of a range, 0 inside).
"""

from __future__ import annotations

from dataclasses import dataclass

TOLERANCE = 0.2  # an "about" figure is reproduced within 20% (DistServe's table's goal, docs/simulator.md)
BOUNDS = ("about", "above", "below", "range")
SIMULATED = "simulated at real scale"


@dataclass(frozen=True)
class Claim:
    key: str  # a short id: the table's rows and the tests name claims by it
    claim: str  # the seed's words, shortened
    source: str  # which seed, which section
    paper: float
    unit: str
    ours: float
    how: str  # SIMULATED, or what was measured where (a CPU model, scaled sizes)
    assumptions: str  # presets, efficiencies, overheads, the workload; what was fitted on what
    bound: str = "about"
    paper_hi: float | None = None  # a range's upper end
    note: str = ""  # why it is not reproduced, and which value of which assumption would reproduce it
    fitted: bool = False  # an assumption was solved so that this row matches (it checks nothing)
    # the operator-level step model's value, where it applies (experiments/sim/attention_ops.py: each of a
    # layer's operators fitted on published GPU profiles of other models): beside ours, the roofline's
    operator: float | None = None

    def __post_init__(self):
        if self.bound not in BOUNDS:
            raise ValueError(f"claim {self.key}: bound must be one of {BOUNDS}, got {self.bound!r}")
        if (self.bound == "range") != (self.paper_hi is not None):
            raise ValueError(f"claim {self.key}: paper_hi goes with bound='range' and only with it")

    @property
    def error(self) -> float:
        """Ours against the figure, relative (0 on the right side of a bound or inside a range)."""
        return self.error_of(self.ours)

    def error_of(self, value: float) -> float:
        """A value against the figure, as `error` measures ours."""
        if self.bound == "range":
            lo, hi = self.paper, self.paper_hi
            return 0.0 if lo <= value <= hi else (value / (lo if value < lo else hi) - 1)
        err = value / self.paper - 1
        if (self.bound == "above" and err >= 0) or (self.bound == "below" and err <= 0):
            return 0.0
        return err

    @property
    def reproduced(self) -> bool:
        return abs(self.error) <= TOLERANCE

    @property
    def figure(self) -> str:
        """The seed's figure as the table prints it."""
        if self.bound == "range":
            return f"{_num(self.paper)}-{_num(self.paper_hi)} {self.unit}"
        word = {"about": "~", "above": "> ", "below": "< "}[self.bound]
        return f"{word}{_num(self.paper)} {self.unit}"


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def fmt(x: float) -> str:
    return _num(x)


def markdown(claims: list[Claim]) -> str:
    """The table docs/results/reproduction.md keeps and `make repro` prints."""
    head = ["claim", "source", "seed", "ours", "error", "", "operator model", "how", "assumptions"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    for c in claims:
        mark = "fitted" if c.fitted else ("yes" if c.reproduced else "**no**")
        cells = [
            f"`{c.key}` {c.claim}",
            c.source,
            c.figure,
            f"{fmt(c.ours)} {c.unit}",
            f"{100 * c.error:+.0f}%",
            mark,
            "-"
            if c.operator is None
            else f"{fmt(c.operator)} {c.unit} ({100 * c.error_of(c.operator):+.0f}%)",
            c.how,
            c.assumptions + (f" *{c.note}*" if c.note else ""),
        ]
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    return "\n".join(lines)
