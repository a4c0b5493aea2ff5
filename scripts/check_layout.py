"""The codebase's layout rules, checked by `make lint` (and so by CI):

- every Python file is at most MAX_LINES lines (a file past it wants splitting where it has a seam);
- tests mirror the packages: a folder under tests/ is a package's folder (tests/experiments/deploy for
  experiments/deploy), and a test named after a module of a subpackage lives in that subpackage's folder
  (tests/experiments/deploy/test_policy.py, not tests/experiments/test_policy.py).

python scripts/check_layout.py [ROOT]; exits 1 with one line per breach.
"""

from __future__ import annotations

import sys
from pathlib import Path

MAX_LINES = 500
SOURCES = ("engine", "experiments", "transfer", "pdkernels", "scripts", "tests")


def too_long(root: Path) -> list[str]:
    out = []
    for top in SOURCES:
        for path in sorted((root / top).rglob("*.py")):
            n = len(path.read_text().splitlines())
            if n > MAX_LINES:
                out.append(f"{path.relative_to(root)}: {n} lines (at most {MAX_LINES})")
    return out


def _modules(package: Path) -> set[str]:
    return {p.stem for p in package.glob("*.py")} | {
        p.name for p in package.iterdir() if (p / "__init__.py").exists()
    }


def misplaced_tests(root: Path) -> list[str]:
    out = []
    tests = root / "tests"
    for path in sorted(tests.rglob("test_*.py")):
        folder = path.parent.relative_to(tests)
        package = root / folder
        if folder.parts and not package.is_dir():
            out.append(
                f"{path.relative_to(root)}: tests/{folder} mirrors no package ({folder} does not exist)"
            )
            continue
        name = path.stem.removeprefix("test_")
        if any(name == m or name.startswith(m + "_") for m in _modules(package)):
            continue  # named after a module here (or a behaviour of none: test_chaos_soak)
        for sub in sorted(p for p in package.iterdir() if (p / "__init__.py").exists()):
            hits = [m for m in _modules(sub) if name == m or name.startswith(m + "_")]
            if hits:
                where = sub.relative_to(root)
                out.append(f"{path.relative_to(root)}: tests {where}/{hits[0]}.py: belongs in tests/{where}/")
    return out


def main(root: Path) -> int:
    breaches = too_long(root) + misplaced_tests(root)
    for line in breaches:
        print(line)
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]))
