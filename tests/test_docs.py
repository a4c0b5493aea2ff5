"""The docs say only what the config has: every `deployment.*`, `workload.*`, `kv_tiers.*`, `model.*`,
`server.*` ... key that README.md or docs/*.md names is a key of the config's one declaration
(experiments/schema.py), so an override the docs show does not fail with hydra's "Key ... is not in
struct"."""

import re
from pathlib import Path

import pytest

from experiments.schema import keys

ROOT = Path(__file__).resolve().parents[1]
GROUPS = "deployment|workload|kv_tiers|model|slo|transfer|server|launcher|ray|cluster|kernels"
# a dotted key after a group's name, not a file name (workload.py, transfer.md), not inside a longer
# dotted name (serving.http.server), not after a "+" (hydra's append of a key the config has not:
# +model.no_such_key=...)
KEY = re.compile(rf"(?<![+\w./-])((?:{GROUPS})(?:\.(?!(?:py|md|json|yaml|log)\b)[a-z_][a-z0-9_]*)+)")
# names that read like keys but are not settings: modules, and a checkpoint's tensor names
NOT_KEYS = ("transfer.backends.", "model.layers")


def _exists(key: str, rows: dict) -> bool:
    """A key of the config, a group of keys (deployment.planner), or inside a field that holds any
    mapping (deployment.speculative.method, cluster.link.rate)."""
    if key in rows or any(k.startswith(key + ".") for k in rows):
        return True
    parts = key.split(".")
    return any(
        (p := ".".join(parts[:i])) in rows and (rows[p] is None or isinstance(rows[p], dict))
        for i in range(len(parts) - 1, 0, -1)
    )


def _missing(text: str) -> list[str]:
    rows = {key: value for key, value, _ in keys()}
    named = [m.group(1) for m in KEY.finditer(text)]
    return [k for k in named if not k.startswith(NOT_KEYS) and not _exists(k, rows)]


def test_every_key_the_docs_name_is_a_key_of_the_config():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    text = "\n".join(p.read_text() for p in docs)
    found = {m.group(1) for m in KEY.finditer(text)}
    assert {"deployment.chunk_size", "workload.sampling.temperature", "kv_tiers.store_bytes"} <= found
    assert {"server.max_sequences_per_client", "transfer.peer_timeout_s", "cluster.link.rate"} <= found
    missing = {k: [p.name for p in docs if k in p.read_text()] for k in _missing(text)}
    assert not missing, f"keys the docs name that the config lacks: {missing}"


@pytest.mark.parametrize(
    "text",
    ["`deployment.no_such_key=1`", "workload.sampling.tempreature", "kv_tiers.host_byts=1", "server.max_nn"],
)
def test_the_check_finds_a_key_the_config_lacks(text):
    assert _missing(text)


# a date, a commit's hash (hex with a letter and a digit), an issue's number: what a lab notebook records
# and an explanation does not; measurements (docs/results/) keep their dates and commits
NOTEBOOK = re.compile(
    r"\b20\d\d-\d\d-\d\d\b|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b|\b[Ii]ssues? #?\d+"
)
PAGE_LINES = 300


def _explanatory() -> list[Path]:
    return sorted(p for p in (ROOT / "docs").glob("*.md"))


def _code() -> list[Path]:
    """Every source file of ours (not this one, whose examples the check must find)."""
    skip = {".venv", ".venv-gpu", ".compat", "outputs", "multirun", "bench_results", "build"}
    here = Path(__file__).resolve()
    return sorted(
        p
        for p in ROOT.rglob("*.py")
        if not skip & set(p.relative_to(ROOT).parts) and ".egg" not in str(p) and p.resolve() != here
    )


def test_explanatory_pages_are_short_and_record_no_dates_commits_or_issues():
    pages = _explanatory()
    assert len(pages) >= 10 and all("results" not in p.parts for p in pages)
    long = {p.name: n for p in pages if (n := len(p.read_text().splitlines())) > PAGE_LINES}
    assert not long, (
        f"pages over {PAGE_LINES} lines (split them, or move measurements to docs/results/): {long}"
    )
    found = {p.name: m.group(0) for p in pages for m in NOTEBOOK.finditer(p.read_text())}
    assert not found, (
        f"dates, commits or issue numbers in explanatory pages (docs/results/ keeps them): {found}"
    )


def test_code_records_no_dates_commits_or_issues():
    files = _code()
    assert len(files) > 100
    found = [f"{p.relative_to(ROOT)}:{m.group(0)}" for p in files for m in NOTEBOOK.finditer(p.read_text())]
    assert not found, f"a comment or docstring says when or which commit or issue, not why: {found}"


@pytest.mark.parametrize(
    "text", ["measured 2026-12-04", "fixed at 4ad3650", "until issue 70", "see issue #5"]
)
def test_the_notebook_check_finds_a_date_a_commit_and_an_issue(text):
    assert NOTEBOOK.search(text)


@pytest.mark.parametrize("text", ["1.4426950408889634", "16777216 bytes", "abababababababab", "cafe"])
def test_the_notebook_check_passes_numbers_and_words(text):
    assert not NOTEBOOK.search(text)
