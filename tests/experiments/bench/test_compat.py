"""make compat (experiments/bench/compat.py): how each client's own output is read, and the server's
timings beside it; the whole run (every client in its own venv against a real server) is marked slow and
runs where `make compat` has set up .compat/."""

import json
import sys
from pathlib import Path

import pytest

from experiments.bench import compat

ROOT = Path(__file__).resolve().parents[3]


def test_percentiles_are_linear_between_ranks_as_numpy_s():
    assert compat.pct([], 50) is None
    assert compat.pct([3.0], 90) == 3.0
    assert compat.pct([1, 2, 3, 4], 50) == 2.5 and compat.pct([1, 2, 3, 4, 5], 90) == pytest.approx(4.6)


def test_the_server_s_figures_of_a_run_come_from_its_request_log():
    """A streamed request's TTFT: when its first token was written (its own line, before the finished
    one); a request that was not streamed: when its token reached the runtime."""
    log = [{"id": "a", "first_chunk_s": 0.12}, {"id": "a", "ttft_s": 0.1, "tpot_s": 0.02}]
    log.append({"id": "b", "ttft_s": 0.3, "tpot_s": None})
    log.append({"id": "c", "ttft_s": None, "tpot_s": None})  # a request refused: no token
    p50, p90, tpot, n = compat.ours(log)
    assert (p50, p90, tpot, n) == (pytest.approx(210.0), pytest.approx(282.0), pytest.approx(20.0), 3)


def test_guidellm_s_report_is_read_by_its_successful_requests():
    def dist(p50, p90, mean=None):
        return {"successful": {"mean": mean, "percentiles": {"p50": p50, "p90": p90}}}

    report = {"benchmarks": [{"metrics": {
        "request_totals": {"successful": 62, "errored": 1, "incomplete": 1},
        "time_to_first_token_ms": dist(120.0, 300.0),
        "inter_token_latency_ms": dist(40.0, 55.0),
        "output_tokens_per_second": dist(None, None, mean=350.0),
    }}]}  # fmt: skip
    row = compat._guidellm_row(report, "guidellm", 64, 64)
    assert (row.ok, row.failed, row.ttft_p50, row.ttft_p90, row.tpot_p50, row.out_tok_s) == (
        62,
        2,
        120.0,
        300.0,
        40.0,
        350.0,
    )


def test_the_sharegpt_like_file_is_real_text_in_sharegpt_s_shape_and_our_runs_read_it_too(tmp_path):
    from engine.weights import load_model
    from experiments.config import WorkloadConfig
    from experiments.workload import make_requests

    path = compat.sharegpt_like(tmp_path / "sharegpt.json", n=40, seed=3)
    data = json.loads(path.read_text())
    assert path.read_text() == compat.sharegpt_like(tmp_path / "again.json", n=40, seed=3).read_text()
    assert len(data) == 40 and len({c["id"] for c in data}) == 40
    asked, replies = [], []
    for c in data:
        (human, gpt) = c["conversations"]
        assert (human["from"], gpt["from"]) == ("human", "gpt")
        asked.append(len(human["value"].split("\n\n", 1)[1].split()))
        replies.append(len(gpt["value"].split()))
    assert all(20 <= a <= 300 for a in asked) and all(10 <= r <= 60 for r in replies)
    assert len(set(asked)) > 20  # of many lengths
    tok = load_model("tiny-random", weights=False).tokenizer
    w = WorkloadConfig(num_requests=40, dataset="sharegpt", dataset_path=str(path))
    requests = make_requests(w, tok, tok.vocab_size, 2048)
    assert len({tuple(r.prompt_ids) for r in requests}) == 40  # every conversation, once


def test_the_table_marks_what_a_client_did_not_measure():
    figures = (90.0, 300.0, 40.5, 1200.0, 85.0, 280.0, 39.0, 512)
    rows = [compat.Row("litellm", "1p1d", 256, 512, 512, 0, *figures),
            compat.Row("aiperf", "colocated", 64, 128, 0, 128, errors=["exited 1"])]  # fmt: skip
    lines = compat.table(rows).splitlines()
    assert lines[2] == "| litellm | 1p1d | 256 | 512 / 0 | 90 / 300 | 85 / 280 | 40.5 | 39.0 | 1,200 |"
    assert lines[3] == "| aiperf | colocated | 64 | 0 / 128 | - / - | - / - | - | - | - |"


@pytest.mark.slow
@pytest.mark.timeout(3600)  # every client at three concurrencies: about 15 minutes
@pytest.mark.skipif(not (ROOT / ".compat/.ready").exists(), reason="make compat sets up the clients' venvs")
def test_every_client_is_served_without_a_failure_and_times_what_the_server_times(tmp_path):
    """Every client at concurrency 8 on colocated: no request fails, and where a client streams, the first
    token it sees is the one the server sent first: its TTFT p50 is within a quarter of the server's decode
    time of the server's own for the same requests, where a buffered stream would show it about the whole
    decode later (a small run; the table of `make compat` compares them at scale). Not a speed check: a
    client's own overhead (LangChain's 46 ms on a busy machine, a third of the TTFT) is not a fault."""
    out = 32
    args = ["--out", str(tmp_path), "--deployments", "colocated", "--concurrency", "8", "--output", str(out)]
    code = compat.main(args)
    rows = json.loads((tmp_path / "compat.json").read_text())["rows"]
    assert code == 0 and [r["failed"] for r in rows] == [0] * len(compat.CLIENTS), rows
    for r in rows:
        if r["client"] != "litellm":  # LiteLLM's own overhead is in its figures (docs/results/compat.md)
            assert r["ttft_p50"] - r["ours_ttft_p50"] < (out - 1) * r["ours_tpot_p50"] / 4, r
    print(compat.table([compat.Row(**r) for r in rows]), file=sys.stderr)
