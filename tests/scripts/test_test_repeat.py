"""scripts/test_repeat.py: N runs of a suite, each failing test counted once per run it failed in."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import test_repeat  # noqa: E402

SUITE = """
import os
from pathlib import Path

def test_ok():
    pass

def test_fails_every_time():
    assert False

def test_fails_on_the_first_run_only(tmp_path_factory):
    marker = Path(os.environ["REPEAT_MARKER"])
    first = not marker.exists()
    marker.touch()
    assert not first
"""


def test_each_failing_test_is_counted_by_the_runs_it_failed(tmp_path, capsys, monkeypatch):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_sample.py").write_text(SUITE)
    monkeypatch.setenv("REPEAT_MARKER", str(tmp_path / "marker"))
    out = tmp_path / "reports"
    code = test_repeat.main(["2", "--out", str(out), "--", str(suite), "-q", "-p", "no:cacheprovider"])
    printed = capsys.readouterr().out
    assert code == 1
    assert "failed 2 of 2: " in printed and "test_fails_every_time" in printed
    assert "failed 1 of 2: " in printed and "test_fails_on_the_first_run_only" in printed
    assert "test_ok" not in printed.split("reports in")[1]
    assert "run 1/2: 1 passed, 2 failed, 0 skipped" in printed
    assert "run 2/2: 2 passed, 1 failed, 0 skipped" in printed
    assert sorted(p.name for p in out.iterdir()) == ["run-1.log", "run-1.xml", "run-2.log", "run-2.xml"]


def test_a_run_that_leaves_no_report_counts_as_failed(tmp_path):
    counts, failing = test_repeat.outcomes(tmp_path / "missing.xml")
    assert counts["failed"] == 1 and failing == ["(no report: pytest did not finish)"]
