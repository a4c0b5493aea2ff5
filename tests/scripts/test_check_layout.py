"""scripts/check_layout.py finds a file past 500 lines and a test outside its package's folder."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("check_layout", ROOT / "scripts" / "check_layout.py")
check_layout = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_layout)


def _tree(root: Path, files: dict[str, int]) -> None:
    for name, lines in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x = 1\n" * lines)


def test_this_repository_keeps_the_rules():
    assert check_layout.main(ROOT) == 0


def test_a_long_file_and_misplaced_tests_are_named(tmp_path, capsys):
    _tree(
        tmp_path,
        {
            "experiments/__init__.py": 1,
            "experiments/run.py": 10,
            "experiments/deploy/__init__.py": 1,
            "experiments/deploy/policy.py": 501,
            "tests/experiments/test_run_faults.py": 5,  # named after experiments/run.py: in place
            "tests/experiments/test_policy_admission.py": 5,  # experiments/deploy/policy.py's: misplaced
            "tests/nowhere/test_x.py": 5,  # no package nowhere/
            "tests/experiments/deploy/test_policy.py": 500,  # in place, and 500 lines is allowed
        },
    )
    assert check_layout.main(tmp_path) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "experiments/deploy/policy.py: 501 lines (at most 500)",
        "tests/experiments/test_policy_admission.py: tests experiments/deploy/policy.py: belongs in "
        "tests/experiments/deploy/",
        "tests/nowhere/test_x.py: tests/nowhere mirrors no package (nowhere does not exist)",
    ]
