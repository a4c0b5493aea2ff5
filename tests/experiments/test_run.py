"""The main job end to end: real worker processes, NIXL between prefill and decode, hydra configs."""

import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest

from experiments.config import from_cfg
from experiments.run import run
from tests import needs
from tests.experiments.runs import TINY, _cfg, _cli, _outputs
from tests.heads import echo_head

needs.nixl()


def test_greedy_outputs_are_identical_colocated_1p1d_and_tp_1_to_2(tmp_path, short_tmp, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(short_tmp.resolve()))  # the workers' (read when each starts)
    deployments = (
        "deployments=[{name: colocated, kind: colocated, num_workers: 1},"
        "{name: 1p1d, kind: disaggregated, num_prefill: 1, num_decode: 1, prefill_kv_layout: NHD},"
        "{name: 1p1d-tp1-2, kind: disaggregated, num_prefill: 1, num_decode: 1, decode_tp: 2,"
        " prefill_page_size: 16}]"  # 1p1d's prefill pages NHD, this one's four of the decode worker's
    )
    records = run(_cfg([*TINY, deployments]), tmp_path, progress=False)
    assert [r["deployment"] for r in records] == ["colocated", "1p1d", "1p1d-tp1-2"]
    for rec in records:
        s = rec["summary"]
        assert s["completed"] == 6 and s["errors"] == 0, rec["requests"]
        assert all(len(ids) == 8 for ids in _outputs(rec).values())
    assert _outputs(records[0]) == _outputs(records[1]) == _outputs(records[2])
    remote = records[1]["requests"]
    assert all(r["prefill"] == "remote" and r["transfer_bytes"] > 0 and r["transfer_s"] > 0 for r in remote)
    assert records[0]["summary"]["transfer_bytes"] == 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["schema"] == "pdkernels.results/1" and len(saved["runs"]) == 3
    header = (tmp_path / "requests-1p1d.csv").read_text().splitlines()[0]
    assert header.startswith("request_id,worker,prefill,prefill_worker,prompt_tokens")
    assert not mp.active_children()  # every worker process is gone
    # and nothing of theirs is left: the TP 2 decode worker's rendezvous folder went with its engine
    assert not list(short_tmp.resolve().glob("pdk-tp-*"))


def test_prefill_workers_with_a_wider_cache_feed_e4m3_decode_workers(tmp_path, short_tmp, monkeypatch):
    """model.kv_dtype=fp8_e4m3 with deployment.prefill_kv_dtype=auto: the prefill worker computes over a
    cache in the model's dtype and each page crosses quantized, the same bytes as from an e4m3 prefill
    worker (pages and scales), and every request completes."""
    monkeypatch.setenv("TMPDIR", str(short_tmp.resolve()))
    deployments = (
        "deployments=[{name: e4m3, kind: disaggregated, num_prefill: 1, num_decode: 1},"
        "{name: wider, kind: disaggregated, num_prefill: 1, num_decode: 1, prefill_kv_dtype: auto}]"
    )
    records = run(_cfg([*TINY, "model.kv_dtype=fp8_e4m3", deployments]), tmp_path, progress=False)
    for rec in records:
        assert rec["summary"]["completed"] == 6 and rec["summary"]["errors"] == 0, rec["requests"]
        assert all(len(ids) == 8 for ids in _outputs(rec).values())
    sent = [{r["request_id"]: r["transfer_bytes"] for r in rec["requests"]} for rec in records]
    assert sent[0] == sent[1] and sum(sent[0].values()) > 0
    assert not mp.active_children()


def test_a_sampled_structured_workload_runs_through_the_main_job(tmp_path):
    """workload.sampling: every request samples (temperature, top_p, seed) within a regex, colocated and
    1P1D: each text keeps to it and ends at the grammar's end."""
    sampling = (
        "workload.sampling={temperature: 1.0, top_p: 0.9, seed: 7, structured_outputs: {regex: '(yes|no)!'}}"
    )
    deployments = (
        "deployments=[{name: colocated, kind: colocated, num_workers: 1},"
        "{name: 1p1d, kind: disaggregated, num_prefill: 1, num_decode: 1}]"
    )
    records = run(_cfg([*TINY, sampling, deployments]), tmp_path, progress=False)
    for rec in records:
        assert rec["summary"]["completed"] == 6 and rec["summary"]["errors"] == 0, rec["requests"]
        texts = [r["text"] for r in rec["requests"]]
        assert all(t in ("yes!", "no!") for t in texts), texts
        assert all(r["finish_reason"] == "stop" for r in rec["requests"])  # the grammar's end, before 8


def test_control_plane_over_tcp_with_curve(tmp_path):
    """control_transport=tcp: every control socket binds to control_host behind CURVE (what a deployment
    across machines needs); the run gives the same greedy tokens as over ipc."""
    runs = {
        transport: run(
            _cfg([*TINY, "deployment=1p1d", f"transfer.control_transport={transport}"]),
            tmp_path / transport,
            progress=False,
        )[0]
        for transport in ("ipc", "tcp")
    }
    assert runs["tcp"]["summary"]["completed"] == 6 and _outputs(runs["tcp"]) == _outputs(runs["ipc"])
    for name in ("prefill-0", "decode-0"):  # and each worker logs to its own file in the run folder
        text = (tmp_path / "tcp" / "logs" / "1p1d" / f"{name}.log").read_text()
        assert f"{name} up: {name.split('-')[0]} worker" in text and f"{name} stopped by the driver" in text
    assert "prefill worker prefill-0 connected" in (tmp_path / "tcp/logs/1p1d/decode-0.log").read_text()


def test_conditional_disaggregation_prefills_short_prompts_on_the_decode_worker(tmp_path):
    overrides = [*TINY, "deployment=1p1d", "deployment.local_prefill_max_tokens=20"]
    (rec,) = run(_cfg(overrides), tmp_path, progress=False)
    for r in rec["requests"]:
        assert r["error"] is None
        assert r["prefill"] == ("local" if r["prompt_tokens"] <= 20 else "remote"), r


@pytest.mark.parametrize(
    "launcher",
    [pytest.param([], marks=pytest.mark.slow), ["experiment=rate_sweep"]],  # make test: the parallel one
    ids=["basic", "joblib"],
)
def test_a_sweep_over_two_rates_gives_two_run_folders_and_a_goodput(tmp_path, launcher):
    args = ["-m", *TINY, *launcher, "deployment=colocated", "deployment.num_workers=1"]  # a core per job
    if launcher:  # side by side where each job has a core of its own (one core: one job at a time)
        args.append(f"hydra.launcher.n_jobs={min(2, len(os.sched_getaffinity(0)))}")
    args += ["workload.arrival=poisson", "workload.rate=2,4"]
    args += ["slo.ttft_s=5", "slo.tpot_s=1", f"hydra.sweep.dir={tmp_path}"]
    out = _cli(args, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    folders = sorted(p.parent.name for p in tmp_path.glob("*/results.json"))
    assert folders == ["0", "1"]
    rates = sorted(
        json.loads((tmp_path / f / "results.json").read_text())["runs"][0]["rate"] for f in folders
    )
    assert rates == [2.0, 4.0]
    goodput = json.loads((tmp_path / "goodput.json").read_text())["goodput_rps"]
    assert goodput["colocated"] == 4.0  # a tiny model meets a loose SLO at both rates
    assert "goodput (req/s)" in out.stdout


def test_a_sharegpt_sample_drives_a_real_run(tmp_path):
    data = Path(__file__).resolve().parents[1] / "data" / "sharegpt_sample.json"
    overrides = [*TINY, "deployment=colocated", "workload.dataset=sharegpt", f"workload.dataset_path={data}"]
    (record,) = run(_cfg(overrides), tmp_path, progress=False)
    assert record["summary"]["completed"] == 6
    assert len({r["prompt_tokens"] for r in record["requests"]}) > 3  # the conversations' own lengths


@pytest.mark.parametrize(  # make test: MTP (ngram's drafts are checked lossless in tests/engine too)
    "method", [pytest.param("ngram", marks=pytest.mark.slow), "mtp"]
)
def test_speculation_through_the_main_job_is_lossless_and_reported(method, tmp_path):
    spec = "speculative: {method: ngram, num_speculative_tokens: 3}"
    if method == "mtp":  # drafting from the hand-off's context on the decode side, TP 1 -> 2 too
        head = echo_head(tmp_path / "echo.safetensors")
        spec = f"speculative: {{method: mtp, num_speculative_tokens: 2, model: '{head}'}}"
    deployments = (
        "deployments=[{name: plain, kind: colocated, num_workers: 1},"
        f"{{name: spec, kind: colocated, num_workers: 1, {spec}}},"
        f"{{name: spec-1p1d, kind: disaggregated, num_prefill: 1, num_decode: 1, {spec}}},"
        f"{{name: spec-tp1-2, kind: disaggregated, num_prefill: 1, num_decode: 1, decode_tp: 2, {spec}}}]"
    )
    records = run(_cfg([*TINY, "workload.output_len.value=24", deployments]), tmp_path, progress=False)
    plain, spec_colocated, spec_1p1d, spec_tp = (_outputs(r) for r in records)
    assert spec_colocated == plain == spec_1p1d == spec_tp  # TP 1 -> 2 drafting on the decode side too
    s = records[1]["summary"]
    assert records[0]["summary"]["spec_acceptance_rate"] is None and s["spec_drafted"] > 0
    assert 0 < s["spec_acceptance_rate"] <= 1 and s["spec_mean_accepted_length"] > 1
    verify_steps = [step[4] for t in records[1]["timelines"] for step in t["steps"]]
    assert sum(verify_steps) > 0  # the timeline marks the steps that verified drafts
    from experiments.plots import timeline

    timeline(records[1], tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 0


@pytest.mark.slow
def test_smollm2_greedy_outputs_are_identical_colocated_and_1p1d(tmp_path):
    overrides = ["model=smollm2-135m", "model.dtype=float32", "plots=false", "workload.num_requests=4"]
    overrides += ["workload.arrival=concurrency", "workload.concurrency=2", "workload.output_len.value=8"]
    overrides += ["workload.prompt_len.value=64", "transfer.peer_timeout_s=60"]
    overrides += [
        "deployments=[{name: colocated, kind: colocated, num_workers: 1},"
        "{name: 1p1d, kind: disaggregated, num_prefill: 1, num_decode: 1},"
        "{name: 1p1d-tp1-3, kind: disaggregated, num_prefill: 1, num_decode: 1, decode_tp: 3}]"
    ]
    records = run(_cfg(overrides), tmp_path, progress=False)
    assert all(r["summary"]["completed"] == 4 for r in records)
    assert _outputs(records[0]) == _outputs(records[1]) == _outputs(records[2])


def test_goodput_search_runs_each_rate_and_reports_the_highest_that_meets_the_slo(tmp_path):
    overrides = [*TINY, "deployment=colocated", "workload.arrival=poisson", "goodput_search.rates=[2,4]"]
    overrides += ["slo.ttft_s=5", "slo.tpot_s=1", "workload.num_requests=4"]
    records = run(_cfg(overrides), tmp_path, progress=False)
    assert [r["rate"] for r in records] == [2, 4]
    from experiments.metrics import goodput

    assert goodput(records) == {"colocated": 4}
    assert all(r["summary"]["goodput_rps"] == r["rate"] for r in records)


def _prefill_tokens(record, role):
    return [step[2] for t in record["timelines"] if t["role"] == role for step in t["steps"] if step[2]]


def test_an_idle_worker_with_gather_ms_lets_a_spread_out_burst_share_its_first_step(tmp_path):
    """Four prompts arriving about 100 ms apart (as a burst does over HTTP, request by request): a worker
    that steps at once takes the first alone; with gather_ms it keeps reading for that long after the first
    and prefills all four in its first step. The outputs are the same."""
    spread = [*TINY[:1], *TINY[8:], "workload.num_requests=4", "workload.arrival=poisson", "workload.rate=10"]
    spread += ["workload.prompt_len.kind=fixed", "workload.prompt_len.value=30"]
    deployments = (
        "deployments=[{name: now, kind: colocated, num_workers: 1},"
        "{name: gather, kind: colocated, num_workers: 1, gather_ms: 1000}]"
    )
    now, gather = run(_cfg([*spread, deployments]), tmp_path, progress=False)
    assert _outputs(now) == _outputs(gather)
    assert _prefill_tokens(now, "colocated")[0] < 120
    assert _prefill_tokens(gather, "colocated")[0] == 120


def test_a_decode_worker_under_memory_pressure_admits_with_room_to_finish_and_refetches(tmp_path):
    """80 pages of 4 tokens; each request needs 23 pages (60 prompt + 30 output tokens), 8 arrive at once.
    Before admission with room to finish, the decode worker reserved every prompt while pages were free,
    ran out as they grew, and recomputed preempted prompts in its decode steps. Now: it queues them, and
    a request that still runs out (no horizon: decode_reserved_tokens=0) is refetched from the prefill
    worker, unless recompute_local says otherwise. Greedy output never changes. (With fair_share, the
    default, a request is owed only its share of the cache: more start at once and some are preempted.)"""
    pressure = ["model.num_pages=80", "workload.num_requests=8", "workload.arrival=poisson"]
    pressure += ["workload.rate=1000", "workload.prompt_len.value=60", "workload.output_len.value=30"]
    common = "kind: disaggregated, num_prefill: 1, num_decode: 1"
    deployments = (
        f"deployments=[{{name: room, {common}, fair_share: false}},"
        f"{{name: refetch, {common}, decode_reserved_tokens: 0}},"
        f"{{name: local, {common}, decode_reserved_tokens: 0, decode_preemption: recompute_local}}]"
    )
    overrides = [*TINY[:1], *TINY[8:], *pressure, "workload.prompt_len.kind=fixed", deployments]
    room, refetch, local = run(_cfg(overrides), tmp_path, progress=False)
    s = room["summary"]  # nothing preempted, nothing recomputed: the reference run
    assert set(s["preemptions"].values()) == set(s["recomputed_prompt_tokens"].values()) == {0}
    for rec in (room, refetch, local):
        assert rec["summary"]["completed"] == 8, rec["requests"]
        assert _outputs(rec) == _outputs(room), rec["deployment"]  # greedy: the same tokens
        assert all(t["free_pages"] == t["num_pages"] == 80 for t in rec["timelines"])  # nothing leaked
    assert _prefill_tokens(room, "decode") == []  # every prompt was prefilled remotely, once
    s = refetch["summary"]
    assert s["preemptions"]["decode-0"] > 0 and s["refetched_tokens"]["decode-0"] > 0
    assert s["recomputed_prompt_tokens"]["decode-0"] == 0 and _prefill_tokens(refetch, "decode") == []
    s = local["summary"]
    assert s["preemptions"]["decode-0"] > 0 and s["recomputed_prompt_tokens"]["decode-0"] > 0
    assert sum(_prefill_tokens(local, "decode")) >= s["recomputed_prompt_tokens"]["decode-0"]


def test_multiturn_conversations_reuse_their_history_and_send_only_the_new_kv(tmp_path):
    """4 conversations x 3 turns through 1P1D with prefix caching on and off: the same replies; with it,
    turns after the first find their history in the decode worker's cache and only the rest is sent."""
    multiturn = [
        "workload=multiturn",
        "workload.conversations=4",
        "workload.turns=3",
        "workload.concurrency=4",
    ]
    multiturn += ["workload.system_prompt_len=40", "workload.turn_len=12", "workload.think_time_s=0.05"]
    multiturn += ["workload.output_len.value=8", "model.page_size=4"]
    common = "kind: disaggregated, num_prefill: 1, num_decode: 1"
    deployments = (
        f"deployments=[{{name: cached, {common}}}, {{name: plain, {common}, prefix_caching: false}}]"
    )
    cached, plain = run(_cfg([*TINY[:1], *TINY[8:], *multiturn, deployments]), tmp_path, progress=False)
    assert cached["summary"]["completed"] == plain["summary"]["completed"] == 12
    assert _outputs(cached) == _outputs(plain)
    rows = {r["request_id"]: r for r in cached["requests"]}
    plain_rows = {r["request_id"]: r for r in plain["requests"]}
    for rid, row in rows.items():
        assert row["prompt_tokens"] == plain_rows[rid]["prompt_tokens"]
        if row["turn"] == 0:
            continue
        assert row["cached_tokens"] >= row["prompt_tokens"] - row["new_tokens"] - 4  # the history, to a page
        assert row["transfer_bytes"] < plain_rows[rid]["transfer_bytes"]
        assert plain_rows[rid]["cached_tokens"] == 0
    turns = cached["summary"]["by_turn"]
    assert [t["turn"] for t in turns] == [0, 1, 2] and all(t["requests"] == 4 for t in turns)
    assert 0 < cached["summary"]["prefix_hit_rate"] and plain["summary"]["prefix_hit_rate"] == 0
    assert cached["summary"]["prefix_hits"]["prefill-0"] > 0  # its own cache: later turns' history
    assert all(t["free_pages"] == t["num_pages"] for rec in (cached, plain) for t in rec["timelines"])
    # each prefill step records its prompt chunks (tokens, first position): later turns' start past
    # the cached history, which the simulator's calibration prices (experiments/sim/calibrate.py)
    for rec, cached_at in ((cached, True), (plain, False)):
        steps = [s for t in rec["timelines"] if t["role"] == "prefill" for s in t["steps"] if s[2]]
        assert steps and all(sum(n for n, _ in s[5]) == s[2] for s in steps)
        assert any(p > 0 for s in steps for _, p in s[5]) == cached_at
        # each decode step records the KV its tokens attend over: the history grows turn by turn
        kv = [s[6] / s[3] for t in rec["timelines"] if t["role"] == "decode" for s in t["steps"] if s[3]]
        assert kv and min(kv) >= 1 and max(kv) > 40 + 2 * 12  # past a later turn's system prompt and turns


def test_cache_aware_routing_keeps_each_conversation_where_its_history_is(tmp_path):
    """Two colocated workers, 3 conversations x 3 turns: cache_aware (the overlap weighted far above the
    load) sends every turn to the worker that served the conversation's last one, and every later turn
    finds its history there; round_robin cannot (3 conversations over 2 workers: some turn switches)."""
    multiturn = ["workload=multiturn", "workload.conversations=3", "workload.turns=3"]
    multiturn += ["workload.concurrency=3", "workload.system_prompt_len=40", "workload.turn_len=12"]
    multiturn += ["workload.think_time_s=0.05", "workload.output_len.value=8", "model.page_size=4"]
    common = "kind: colocated, num_workers: 2"
    deployments = (
        f"deployments=[{{name: cache, {common}, routing_overlap_weight: 100}},"
        f"{{name: rr, {common}, routing: round_robin}}]"
    )
    cache, rr = run(_cfg([*TINY[:1], *TINY[8:], *multiturn, deployments]), tmp_path, progress=False)
    assert cache["summary"]["completed"] == rr["summary"]["completed"] == 9
    assert _outputs(cache) == _outputs(rr)

    def by_conversation(record):
        rows = sorted(record["requests"], key=lambda r: (r["conversation"], r["turn"]))
        return {c: [r for r in rows if r["conversation"] == c] for c in range(3)}

    switched = 0
    for turns in by_conversation(cache).values():
        assert len({r["worker"] for r in turns}) == 1
        for r in turns[1:]:
            assert r["cached_tokens"] >= r["prompt_tokens"] - 12 - 4  # all but the new message, to a page
    for turns in by_conversation(rr).values():
        for prev, r in zip(turns, turns[1:], strict=False):
            if r["worker"] != prev["worker"]:
                switched += 1
                assert r["cached_tokens"] < r["prompt_tokens"] - 12 - 4
    assert switched >= 1

    def later_turns_hit_rate(record):  # the first turns race for the system prompt's pages: left out
        later = [r for r in record["requests"] if r["turn"] > 0]
        return sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later)

    assert later_turns_hit_rate(cache) > later_turns_hit_rate(rr)
    assert 0 < rr["summary"]["prefix_hit_rate"] < 1 and 0 < cache["summary"]["prefix_hit_rate"] < 1


def test_admission_slo_refuses_requests_it_predicts_late_and_serves_the_rest_exactly(tmp_path):
    """1P1D under a burst far past a 20 ms TTFT: with deployment.admission=slo the router refuses
    requests at once (rejected, not errors: no worker saw them) from the speed each worker timed as it
    started, and every request it admitted ends with LLM.generate's output; admission=none over the same
    arrivals refuses none. (Whether the first request fits depends on that speed: beside busy loops it
    did not, so nothing here asks.)"""
    from engine import LLM, SamplingParams
    from experiments.workload import make_requests
    from serving.config import check_fits_model

    overrides = [*TINY, "workload.arrival=poisson", "workload.rate=40", "workload.num_requests=48"]
    overrides += ["workload.prompt_len.low=150", "workload.prompt_len.high=300"]
    overrides += ["workload.output_len.value=4"]
    overrides += ["slo.ttft_s=0.02", "deployment.prefix_caching=false"]
    pair = "kind: disaggregated, num_prefill: 1, num_decode: 1, prefix_caching: false"
    overrides += [f"deployments=[{{name: none, {pair}}}, {{name: slo, {pair}, admission: slo}}]"]
    config = from_cfg(_cfg(overrides))
    m = check_fits_model(config)
    requests = make_requests(config.workload, m.tokenizer, m.config.vocab_size, m.config.max_position)
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    want = {r.request_id: w.token_ids for r, w in zip(requests, LLM("tiny-random").generate(
        [list(r.prompt_ids) for r in requests], params), strict=True)}  # fmt: skip
    none, slo = run(_cfg(overrides), tmp_path, progress=False)
    assert none["summary"]["rejected"] == 0 and none["summary"]["completed"] == 48
    s = slo["summary"]
    assert s["rejected"] > 0 and s["errors"] == 0 and s["completed"] + s["rejected"] == 48, slo["requests"]
    refused = [r for r in slo["requests"] if r["finish_reason"] == "rejected"]
    assert all("predicted TTFT" in r["error"] and r["worker"] == "" and not r["output_ids"] for r in refused)
    served = {r["request_id"]: r["output_ids"] for r in slo["requests"] if r["finish_reason"] != "rejected"}
    assert served == {rid: want[rid] for rid in served}
    assert s["admitted_attainment_pct"] >= s["attainment_pct"]
    assert all(t["free_pages"] == t["num_pages"] for t in slo["timelines"])


def test_num_workers_auto_runs_the_split_of_the_cores_it_chose_and_records_why(tmp_path):
    """num_workers: auto times this machine's steps on each thread count, simulates the run's requests
    through each split of the job's cores, runs the chosen one and keeps the table in the record."""
    from experiments.layout import job_cores, splits

    records = run(
        _cfg([*TINY, "deployment=colocated", "deployment.num_workers=auto"]), tmp_path, progress=False
    )
    (rec,) = records
    table = rec["layout_choice"]
    assert sorted((r["num_workers"], r["threads_per_worker"]) for r in table) == sorted(splits(job_cores()))
    assert all(0 <= r["simulated_attainment_pct"] <= 100 and r["fit_error_pct"] >= 0 for r in table)
    assert len([t for t in rec["timelines"] if t["role"] == "colocated"]) == table[0]["num_workers"]
    assert rec["summary"]["completed"] == 6
