"""The main job's config and CLI: every wrong value refused before any process starts, naming the key."""

import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from experiments.config import from_cfg
from experiments.run import run
from tests import needs
from tests.experiments.runs import TINY, _cfg, _cli

needs.nixl()


@pytest.mark.parametrize(
    "override, message",
    [
        ("deployment.decode_tp=3", "decode_tp=3 does not fit tiny-random"),
        ("model.expert_parallel=true", "does not fit tiny-random: expert_parallel needs an MoE model"),
        ("slo.ttft_s=0", "slo.ttft_s=0 is not allowed: must be a number > 0"),
        ("workload.rate=-1", "workload.rate=-1 is not allowed: must be a number > 0"),
        (
            "workload.prompts_file=/nonexistent/prompts.txt",
            "workload.prompts_file='/nonexistent/prompts.txt'",
        ),
        ("transfer.on_transfer_failure=retry", "on_transfer_failure must be one of ('fail', 'recompute')"),
        (
            "workload.arrival=burst",
            "workload.arrival='burst' is not allowed: one of ('auto', 'poisson', 'concurrency', 'trace')",
        ),
        (
            "deployment.decode_preemption=drop",
            "decode_preemption='drop' is not allowed: one of ('refetch', 'recompute_local')",
        ),
        ("deployment.decode_reserved_tokens=-1", "decode_reserved_tokens=-1 is not allowed: null or an"),
        (
            "deployment.chunk_size=big",
            "deployment.chunk_size (or auto, or slo)='big' is not allowed: must be an integer",
        ),
        (
            "deployment.chunk_size=0",
            "deployment.chunk_size (or auto, or slo)=0 is not allowed: must be an integer > 0",
        ),
        (
            "deployment.prefill_page_size=6",
            "prefill workers' KV cannot go to its decode workers (prefill_page_size, prefill_kv_layout, "
            "prefill_kv_dtype, prefill_tp, decode_tp): prefill page_size 6 and decode page_size 4: one must "
            "divide the other",
        ),
        (
            "deployment.prefill_page_size=0",
            "deployment.prefill_page_size (or null)=0 is not allowed: must be an integer > 0",
        ),
        (
            "deployments=[{name: d, kind: disaggregated, num_prefill: 1, num_decode: 1, decode_tp: 2, "
            "prefill_kv_layout: NHD}]",
            "an NHD prefill side sends whole pages of its ranks' heads, and decode ranks here hold other",
        ),
        ("model.kv_layout=HDN", "model.kv_layout='HDN' is not allowed: one of ('HND', 'NHD')"),
        ("deployment.prefill_kv_layout=nhd", "prefill_kv_layout='nhd' is not allowed: null or one of"),
        ("deployment.gather_ms=-1", "gather_ms=-1 is not allowed: a number of milliseconds from 0 to 1000"),
        (
            "deployment.local_prefill_by_load=maybe",
            "local_prefill_by_load='maybe' is not allowed: true or false",
        ),
        (
            "kv_tiers.decode_loads=sometimes",
            "kv_tiers.decode_loads must be one of ('cost', 'always', 'never'), got 'sometimes'",
        ),
        (
            "deployment.gather_ms=5000",
            "gather_ms=5000 is not allowed: a number of milliseconds from 0 to 1000",
        ),
        (
            "deployment.gather_ms=true",
            "gather_ms=True is not allowed: a number of milliseconds from 0 to 1000",
        ),
        ("log_level=LOUD", "log_level='LOUD' is not allowed: one of ('DEBUG', 'INFO', 'WARNING', 'ERROR')"),
        ("transfer.control_transport=udp", "control_transport must be one of ('ipc', 'tcp')"),
        ("kernels.backend=cutlass", "kernels.backend='cutlass' is not allowed: one of ('auto', 'triton'"),
        ("model.device=tpu", "model.device='tpu' is not allowed: one of ('auto', 'cpu', 'cuda')"),
        ("workload.sampling.temperature=-1", "workload.sampling.temperature: temperature must be 0 (greedy)"),
        ("+workload.sampling.tempreature=1", "workload.sampling has unknown key(s) ['tempreature']"),
        ("+workload.sampling.n=2", "workload.sampling.n=2 is not allowed: the workload sets it: one"),
        ("+workload.sampling.max_tokens=9", "max_tokens=9 is not allowed: the workload sets it: each"),
        ("workload.sampling.min_p=2", "workload.sampling.min_p: min_p must be in [0, 1], got 2"),
        (
            "kv_tiers.host_bytes=lots",
            "kv_tiers.host_bytes='lots' is not allowed: a size in bytes: an integer >= 0 or a number with a "
            "unit of ['KiB', 'MiB', 'GiB', 'TiB']",
        ),
        ("kv_tiers.host_bytes=-1", "kv_tiers.host_bytes=-1 is not allowed: a size in bytes"),
        ("kv_tiers.policy=lru", "kv_tiers.policy must be one of ('on_evict', 'write_through'), got 'lru'"),
        ("kv_tiers.store=redis", "kv_tiers.store must be one of ('none', 'mooncake'), got 'redis'"),
        ("kv_tiers.disk_bytes=1GiB", "kv_tiers.disk_bytes and kv_tiers.store stage pages through the host"),
        ("+kv_tiers.hots_bytes=1", "kv_tiers has unknown key(s) ['hots_bytes']"),
        (
            "kv_tiers.store=mooncake",  # with host_bytes 0
            "kv_tiers.disk_bytes and kv_tiers.store stage pages through the host pool",
        ),
        ("model.kv_dtype=fp8", "model.kv_dtype='fp8' is not allowed: one of ('auto', 'fp8_e4m3')"),
        (  # deployment=1p1d: the scales cross the wire with their pages, of one page size
            ("model.kv_dtype=fp8_e4m3", "deployment.prefill_page_size=8"),
            "prefill page_size 8 and decode page_size 4 with scaled (fp8_e4m3) pages: a page's scale covers",
        ),
        (  # e4m3 pages may come from a wider cache (quantized as sent), never go to one
            "deployment.prefill_kv_dtype=fp8_e4m3",
            "prefill_kv_dtype, prefill_tp, decode_tp): an e4m3 prefill side's KV cannot go to a",
        ),
        (
            "deployment.prefill_kv_dtype=fp8",
            "deployment.prefill_kv_dtype='fp8' is not allowed: null or one of ('auto', 'fp8_e4m3')",
        ),
        (
            ("model.kv_dtype=fp8_e4m3", "deployment.speculative={method: ngram, num_speculative_tokens: 2}"),
            "speculative decoding (drafts would move its scales) and CUDA graphs; got speculative_config",
        ),
        (
            "workload.sampling.structured_outputs={regex: 1}",
            "workload.sampling.structured_outputs.regex: structured_outputs.regex must be a non-empty string",
        ),
    ]
    + (
        []
        if torch.cuda.is_available()
        else [("model.device=cuda", "model.device='cuda' is not allowed: this machine has no CUDA device")]
    ),
)
def test_bad_configs_fail_before_any_process_starts(tmp_path, override, message):
    with pytest.raises(ValueError) as err:
        overrides = [override] if isinstance(override, str) else list(override)
        run(_cfg(["model=tiny-random", "deployment=1p1d", *overrides]), tmp_path, progress=False)
    assert message in str(err.value)
    assert not mp.active_children()


SAMPLE = [
    "workload.dataset=mooncake",
    f"workload.dataset_path={Path(__file__).parents[1]}/data/mooncake_sample.jsonl",
]


@pytest.mark.parametrize(
    "overrides, message",
    [  # a request due after run_timeout_s was never sent, and the run waited it out and exited 0
        (
            ["workload.rate=0.01", "workload.num_requests=20", "run_timeout_s=600"],
            "past run_timeout_s=600: raise run_timeout_s, or change workload.rate or workload.num_requests",
        ),
        (
            [*SAMPLE, "workload.num_requests=12", "run_timeout_s=5"],  # its clock spans 8.07 s
            "the workload's last request arrives 8 s after the first (trace), past run_timeout_s=5",
        ),
        (
            [*SAMPLE, "workload.num_requests=12", "goodput_search.rates=[1,2]"],
            "rates needs workload.arrival=poisson, not trace (a mooncake trace replays its own clock unless",
        ),
        (["launcher=netns", "cluster.link.rate=0bit"], "cluster.link.rate='0bit' is not allowed: a tc rate"),
        (["launcher=netns", "cluster.link.rate=100tbit"], "cluster.link.rate='100tbit' is not allowed"),
    ],
)
def test_a_workload_or_link_that_cannot_run_as_asked_is_refused_before_anything_starts(
    tmp_path, overrides, message
):
    with pytest.raises(ValueError) as err:
        run(_cfg(["model=tiny-random", "deployment=1p1d", *overrides]), tmp_path, progress=False)
    assert message in str(err.value)
    assert not mp.active_children() and not list(tmp_path.iterdir())  # nothing started, nothing written


@pytest.mark.parametrize("what", ["cores", "memory"])
def test_a_fleet_that_cannot_fit_the_machine_is_refused_naming_its_cores_and_memory(tmp_path, what):
    """More worker processes than 4 a core, or KV pages past the memory available: refused before any
    process starts (64 workers on 2 cores had started 14 processes and 2.6 GB within 5 s), the message
    naming both the cores and the memory."""
    cores = len(os.sched_getaffinity(0))
    fleet = ["deployment=colocated", f"deployment.num_workers={4 * cores + 1}"]
    if what == "memory":
        fleet = ["deployment=1p1d", "model.num_pages=1000000000"]  # terabytes of KV
    with pytest.raises(ValueError) as err:
        run(_cfg(["model=tiny-random", *fleet]), tmp_path, progress=False)
    message = str(err.value)
    assert "does not fit this machine" in message and f"on {cores} cores" in message, message
    assert "GiB of memory" in message and "GiB available" in message, message
    assert not mp.active_children()


def test_a_deployment_that_an_experiment_would_ignore_is_refused(tmp_path):
    out = _cli(["experiment=compare", "deployment=2p1d", f"hydra.run.dir={tmp_path}"], tmp_path)
    assert out.returncode == 2 and "deployment is ignored here" in out.stderr, out.stderr[-2000:]
    assert "['colocated', '1p1d', 'colocated-slo']" in out.stderr


def test_unknown_deployment_is_refused_by_the_cli(tmp_path):
    out = _cli(["deployment=3p9d", f"hydra.run.dir={tmp_path}"], tmp_path)
    assert out.returncode != 0
    assert "deployment/3p9d" in out.stderr and "1p1d" in out.stderr  # hydra lists the options


@pytest.mark.slow  # make test-all: 13 s of joblib workers starting before each refuses
def test_a_parallel_sweep_whose_jobs_cannot_each_have_their_own_cores_is_refused(tmp_path):
    n_jobs = len(os.sched_getaffinity(0)) + 1  # one core each: one job too many
    rates = ",".join(str(r + 1) for r in range(n_jobs))
    args = ["-m", *TINY, "experiment=rate_sweep", f"hydra.launcher.n_jobs={n_jobs}", "deployment=colocated"]
    args += ["workload.arrival=poisson", f"workload.rate={rates}", f"hydra.sweep.dir={tmp_path}"]
    out = _cli(args, tmp_path)
    assert out.returncode != 0 and f"hydra.launcher.n_jobs={n_jobs} parallel jobs" in out.stderr, out.stderr
    assert "would measure each other" in out.stderr


def test_config_maps_to_dataclasses():
    from pdkernels.cpuinfo import native_bf16

    config = from_cfg(_cfg(["experiment=compare"]))
    assert [d.name for d in config.deployments] == ["colocated", "1p1d", "colocated-slo"]
    assert (
        config.workload.arrival == "poisson"
        and config.workload.num_requests == 24
        and config.workload.load == 1.2
    )
    assert config.transfer.backend == "nixl" and config.model.name == "smollm2-135m"
    assert config.kernels.backend == "auto"
    cpu = not torch.cuda.is_available()
    assert config.model.device == ("cpu" if cpu else "cuda")  # auto, resolved once in the driver
    bf16 = "bfloat16" if not cpu or native_bf16() else "float32"  # auto: by the CPU's ISA
    assert config.model.dtype == bf16
    one_at_a_time = from_cfg(_cfg(["experiment=compare_concurrency1"]))
    assert one_at_a_time.workload.arrival == "concurrency" and one_at_a_time.workload.num_requests == 20
    assert one_at_a_time.model.dtype == "bfloat16"
    assert from_cfg(_cfg(["model=random-llama-1b"])).model.dtype == bf16
    assert from_cfg(_cfg([])).model.dtype == bf16  # the default, smollm2-135m: fp32 where bf16 only converts
    assert from_cfg(_cfg(["model=tiny-random-deepseek", "model.expert_parallel=true"])).model.expert_parallel


def test_an_endpoint_is_the_experiment_s_config_not_the_runtime_s():
    """`kind: endpoint` (a URL the load client measures) is experiments.config.EndpointConfig, kept in its
    place among the deployments; the runtime's own config (the server's) has no such kind."""
    from experiments.config import EndpointConfig
    from serving.config import DeploymentConfig, runtime_of

    url = "http://127.0.0.1:9/v1"
    listed = f"deployments=[{{name: a, kind: endpoint, url: '{url}'}}, {{name: b, kind: colocated}}]"
    config = from_cfg(_cfg([listed]))
    assert [type(d) for d in config.deployments] == [EndpointConfig, DeploymentConfig]
    assert config.deployments[0].url == url and config.deployments[0].processes == 0
    only = from_cfg(_cfg([f"deployments=[{{name: a, kind: endpoint, url: '{url}'}}]"]))
    assert [d.name for d in only.deployments] == ["a"]
    with pytest.raises(ValueError, match="deployment.a.url=.* is not allowed: an http:// or https://"):
        from_cfg(_cfg(["deployments=[{name: a, kind: endpoint, url: 'ftp://x'}]"]))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['url'\]"):
        runtime_of(_cfg([listed]))


def test_a_long_tmpdir_still_gives_sockets_the_kernel_takes(tmp_path, monkeypatch):
    """A unix socket's path holds 107 bytes: under a TMPDIR so deep that a worker's socket would pass it,
    the run's private directory goes to /tmp (still 0700) instead of failing with a ZMQ error at start."""
    import shutil
    import tempfile

    from serving.control import IPC_PATH_MAX, private_dir

    deep = tmp_path / ("d" * 60) / ("e" * 40)
    deep.mkdir(parents=True)
    names = ["prefill-0", "decode-0"]
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    made = private_dir(names)
    try:
        socket = "/decode-0-4194303-prefill-0"  # a decode worker's, with its pid
        assert Path(made).parent == Path("/tmp") and len(made) + len(socket) <= IPC_PATH_MAX
        assert os.stat(made).st_mode & 0o777 == 0o700 and list(deep.iterdir()) == []
    finally:
        os.rmdir(made)
    short = tempfile.mkdtemp(prefix="pdkt-", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", short)
    try:
        near = private_dir(names)
        assert Path(near).parent == Path(short)  # a short TMPDIR is kept
    finally:
        shutil.rmtree(short)


def test_the_prefill_budget_auto_is_picked_by_what_computes_the_step(monkeypatch):
    """deployment.chunk_size=auto (the default): vLLM's CPU budget on AVX-512 BF16 or AMX CPUs running a
    bf16 model, 1,024 on a CPU in fp32, each where it was measured better; 512 on a GPU or in bf16 on a
    CPU without bf16 compute."""
    from pdkernels import cpuinfo
    from serving.config import DeploymentConfig, prefill_budget

    assert DeploymentConfig(name="d").chunk_size == "auto"
    for native, device, dtype, want in [
        (True, "cpu", "bfloat16", 2048),
        (True, "cpu", "float32", 1024),
        (False, "cpu", "float32", 1024),
        (True, "cuda", "bfloat16", 512),
        (True, "cuda", "float32", 512),
        (False, "cpu", "bfloat16", 512),
    ]:
        monkeypatch.setattr(cpuinfo, "native_bf16", lambda native=native: native)
        assert prefill_budget("auto", device, dtype) == want, (native, device, dtype)
        assert prefill_budget(300, device, dtype) == 300  # a number is kept as it is
