import pytest

from experiments.repro.claims import SIMULATED, Claim, markdown


def _claim(ours: float, bound: str = "about", paper_hi: float | None = None, **kw) -> Claim:
    return Claim(
        "k", "a claim", "a seed", 10.0, "ms", ours, SIMULATED, "none", bound=bound, paper_hi=paper_hi, **kw
    )


def test_an_about_figure_is_reproduced_within_20_percent_either_way():
    assert _claim(11.9).reproduced and _claim(8.1).reproduced
    assert not _claim(12.1).reproduced and not _claim(7.9).reproduced
    assert _claim(15.0).error == pytest.approx(0.5)


def test_a_bound_counts_only_the_wrong_side():
    assert _claim(100.0, "above").error == 0 and _claim(1.0, "below").error == 0
    assert _claim(7.0, "above").error == pytest.approx(-0.3) and not _claim(7.0, "above").reproduced
    assert _claim(13.0, "below").error == pytest.approx(0.3)


def test_a_range_is_met_inside_and_measured_from_its_nearer_end():
    assert _claim(30.0, "range", 50.0).error == 0
    assert _claim(60.0, "range", 50.0).error == pytest.approx(0.2)
    assert _claim(5.0, "range", 50.0).error == pytest.approx(-0.5)
    assert _claim(40.0, "range", 50.0).figure == "10-50 ms"


def test_a_malformed_claim_is_refused_naming_what_is_wrong():
    with pytest.raises(ValueError, match="bound must be one of"):
        _claim(1.0, "roughly")
    with pytest.raises(ValueError, match="paper_hi goes with bound='range'"):
        _claim(1.0, "range")
    with pytest.raises(ValueError, match="paper_hi goes with bound='range'"):
        _claim(1.0, "about", 20.0)


def test_the_table_marks_fitted_rows_and_misses_and_keeps_its_columns():
    rows = [_claim(10.0), _claim(30.0, note="why | not"), _claim(10.0, fitted=True, operator=12.0)]
    lines = markdown(rows).splitlines()
    assert len(lines) == 5 and all(line.count(" | ") == 8 for line in lines[2:])  # a | in a note is escaped
    assert "| yes | - |" in lines[2] and "| **no** |" in lines[3] and "| fitted | 12 ms (+20%) |" in lines[4]
    inside = markdown([_claim(10.0, "range", 20.0, operator=15.0)]).splitlines()[2]
    assert "| 15 ms (+0%) |" in inside  # the operator model's value judged as ours is: inside the range
    assert "+200%" in lines[3] and "*why / not*" in lines[3]
