"""A deployment's worker gets its engine's whole config from one function, serving.config.engine_config,
run in the main process before any worker starts: the model's and deployment's keys under the engine's
names, and what they leave to derive resolved there."""

from dataclasses import replace

import pytest

from engine.role import Role
from serving.config import DeploymentConfig, ModelSpec, engine_config

MODEL = ModelSpec(
    name="tiny-random", dtype="float32", device="cpu", page_size=8, num_pages=96, max_num_seqs=5
)
SPEC = {"method": "ngram", "num_speculative_tokens": 2}


def _d(**kw) -> DeploymentConfig:
    return DeploymentConfig(name="d", kind="disaggregated", num_prefill=1, num_decode=1, **kw)


def test_the_model_and_deployment_keys_land_under_the_engine_names():
    e = engine_config(MODEL, _d(prefill_tp=2, prefix_caching=False, decode_reserved_tokens=64), Role.PREFILL,
                      0.1, seed=3)  # fmt: skip
    assert (e.model, e.device, e.dtype, e.seed, e.tp, e.dp) == ("tiny-random", "cpu", "float32", 3, 2, 1)
    assert (e.cache.page_size, e.cache.num_pages, e.cache.enable_prefix_caching) == (8, 96, False)
    assert (e.scheduler.role, e.scheduler.max_num_seqs, e.scheduler.reserved_tokens) == (Role.PREFILL, 5, 64)
    assert e.scheduler.max_num_batched_tokens == 1024  # chunk_size auto, a CPU in fp32
    assert not e.kv_tiers.enabled


@pytest.mark.parametrize(
    "chunk_size, tpot_s, budget, target",
    [("auto", 0.1, 1024, None), (300, 0.1, 300, None), ("slo", 0.1, 1024, 0.09), ("slo", 0.2, 1024, 0.18)],
)
def test_chunk_size_resolves_to_a_budget_and_slo_to_a_step_target(chunk_size, tpot_s, budget, target):
    s = engine_config(MODEL, _d(chunk_size=chunk_size), Role.DECODE, tpot_s).scheduler
    assert s.max_num_batched_tokens == budget and s.step_target_s == pytest.approx(target)


def test_preemption_and_speculation_follow_the_role():
    d = _d(speculative=SPEC)
    prefill, decode = (engine_config(MODEL, d, role, 0.1) for role in (Role.PREFILL, Role.DECODE))
    assert prefill.speculative_config is None  # it never samples
    assert decode.speculative_config.num_speculative_tokens == 2
    elastic = engine_config(MODEL, _d(speculative=SPEC, planner={"manual": True}), Role.PREFILL, 0.1)
    assert elastic.speculative_config is not None  # it may come to decode
    assert decode.scheduler.preemption == "refetch"
    local = engine_config(MODEL, _d(decode_preemption="recompute_local"), Role.DECODE, 0.1)
    assert local.scheduler.preemption == "recompute"


@pytest.mark.parametrize("prefill_page_size, num_pages", [(32, 24), (2, 384), (8, 96)])
def test_prefill_workers_of_another_page_size_hold_the_same_tokens(prefill_page_size, num_pages):
    d = _d(prefill_page_size=prefill_page_size, prefill_kv_layout="NHD")
    prefill, decode = (engine_config(MODEL, d, role, 0.1).cache for role in (Role.PREFILL, Role.DECODE))
    assert (prefill.page_size, prefill.num_pages, prefill.kv_layout) == (prefill_page_size, num_pages, "NHD")
    assert (decode.page_size, decode.num_pages, decode.kv_layout) == (8, 96, "HND")


def test_prefill_workers_may_keep_a_wider_cache_than_e4m3_decode_workers():
    model = replace(MODEL, kv_dtype="fp8_e4m3")
    d = _d(prefill_page_size=None, prefill_kv_dtype="auto")
    prefill, decode = (engine_config(model, d, role, 0.1).cache for role in (Role.PREFILL, Role.DECODE))
    assert (prefill.kv_dtype, decode.kv_dtype) == ("auto", "fp8_e4m3")
    assert engine_config(model, _d(prefill_page_size=None), Role.PREFILL, 0.1).cache.kv_dtype == "fp8_e4m3"


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            dict(kind="colocated", num_workers=1),
            "prefill_page_size=16 is not allowed: null for kind=colocated",
        ),
        (
            dict(kind="colocated", num_workers=1, prefill_page_size=None, prefill_kv_dtype="auto"),
            "prefill_kv_dtype='auto' is not allowed: null for kind=colocated",
        ),
        (
            dict(prefill_page_size=None, prefill_kv_dtype="auto", prefill_dp=2),
            "prefill_kv_dtype='auto' is not allowed: null where prefill_dp > 1",
        ),
        (
            dict(prefill_page_size=None, prefill_kv_dtype="bf16"),
            "prefill_kv_dtype='bf16' is not allowed: null or one of ('auto', 'fp8_e4m3')",
        ),
        (dict(planner={"manual": True}), "prefill_page_size=16 is not allowed: null where elastic workers"),
        (dict(prefill_page_size=-4), "prefill_page_size (or null)=-4 is not allowed"),
        (dict(prefill_page_size=2.5), "prefill_page_size (or null)=2.5 is not allowed"),
        (
            dict(kind="colocated", num_workers=1, prefill_page_size=None, prefill_kv_layout="NHD"),
            "prefill_kv_layout='NHD' is not allowed: null for kind=colocated",
        ),
    ],
)
def test_a_prefill_page_size_where_it_cannot_apply_is_refused(kw, message):
    kw = {"kind": "disaggregated", "num_prefill": 1, "num_decode": 1, "prefill_page_size": 16, **kw}
    with pytest.raises(ValueError) as e:
        DeploymentConfig(name="d", **kw)
    assert message in str(e.value)


def test_a_deployment_the_engine_refuses_is_refused_here_naming_the_setting():
    with pytest.raises(ValueError, match="dp=2 .* runs without speculative_config"):
        engine_config(MODEL, _d(decode_dp=2, speculative=SPEC), Role.DECODE, 0.1)


def test_a_front_reads_its_config_and_names_pages_without_torch():
    """What a server's or job's own process does (its modules, a model's config and tokenizer, the
    deployment's settings, the router's page names) imports no torch: only the workers run the model."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import experiments.run, experiments.serve, serving.http.server\n"
        "from engine.weights import load_model\n"
        "from serving.config import ModelSpec, DeploymentConfig, engine_config\n"
        "from serving.router.belief import page_names\n"
        "for name in ('tiny-random', 'smollm2-135m'):\n"
        "    loaded = load_model(name, weights=False)\n"
        "spec = ModelSpec(name='tiny-random', dtype='auto', device='auto')\n"
        "from engine.role import Role\n"
        "engine_config(spec, DeploymentConfig(name='d'), Role.COLOCATED, 0.1)\n"
        "assert len(page_names(list(range(40)), 16)) == 2\n"
        "print(sorted(m for m in ('torch', 'triton', 'xgrammar', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-3000:] + out.stdout
