"""One EngineConfig builds an engine (engine/config.py): LLM(config) and LLM(model, **overrides) are the same
engine, an override's name is routed to the part that declares it, and a name nothing declares is refused
with the allowed ones."""

import pytest

from engine import LLM, SamplingParams
from engine.config import CacheConfig, EngineConfig, SchedulerConfig, settings
from engine.role import Role

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def test_overrides_reach_the_part_that_declares_them():
    c = EngineConfig.of("tiny-random", page_size=8, num_pages=40, role="prefill", max_num_batched_tokens=64,
                        tp=1, kv_tiers={"host_bytes": 1 << 20})  # fmt: skip
    assert c.model == "tiny-random" and c.cache == CacheConfig(page_size=8, num_pages=40)
    assert c.scheduler == SchedulerConfig(role=Role.PREFILL, max_num_batched_tokens=64)
    assert c.kv_tiers.host_bytes == 1 << 20 and c.arch is None
    # overrides on a config keep what they do not name
    d = EngineConfig.of(c, num_pages=50)
    assert d.cache.page_size == 8 and d.cache.num_pages == 50 and d.scheduler.role == Role.PREFILL
    # every name LLM takes is one of the config's, once
    names = list(settings())
    assert len(names) == len(set(names)) and {"page_size", "role", "tp", "kv_tiers"} <= set(names)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(pagesize=8), "pagesize"),
        (dict(arch=None), "arch"),  # set by the engine as it reads the model, never by a caller
        (dict(dp_rendezvous="/tmp/x"), "dp_rendezvous"),
    ],
)
def test_a_name_nothing_declares_is_refused_with_the_allowed_ones(overrides, field):
    with pytest.raises(ValueError, match=f"no setting '{field}'; allowed: .*'page_size'"):
        EngineConfig.of("tiny-random", **overrides)
    with pytest.raises(ValueError, match=f"no setting '{field}'"):
        LLM("tiny-random", **overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(page_size=0), "page_size must be >= 1"),
        (dict(role="both"), "role"),
        (dict(preemption="later"), "preemption must be one of"),
        (dict(dp=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "dp=2"),
        (dict(kv_tiers={"host_bytes": 1 << 20}, enable_prefix_caching=False), "enable_prefix_caching=True"),
        (dict(model=""), "model must be"),
    ],
)
def test_a_bad_value_is_refused_before_any_model_is_read(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.of("tiny-random", **overrides)


def test_the_checks_that_need_the_model_run_once_it_is_read():
    EngineConfig.of("tiny-random", tp=3)  # the shape is unknown yet: nothing to check tp against
    with pytest.raises(ValueError, match="tp=3 must divide"):
        LLM("tiny-random", tp=3)  # read, refused before any rank starts


def test_a_config_and_its_keywords_build_the_same_engine():
    by_config = LLM(EngineConfig(model="tiny-random", cache=CacheConfig(page_size=8, num_pages=64)))
    by_keywords = LLM("tiny-random", page_size=8, num_pages=64)
    assert by_config.config == by_keywords.config and by_config.config.arch.num_layers == 4
    prompt = [[5, 6, 7, 8, 9]]
    assert (
        by_config.generate(prompt, GREEDY)[0].token_ids == by_keywords.generate(prompt, GREEDY)[0].token_ids
    )


def test_cuda_is_asked_of_torch_only_where_a_gpus_device_files_exist(monkeypatch):
    """engine.config.cuda_available: no NVIDIA, ROCm or WSL device file, no GPU (torch not asked: a front
    need not import it); where one exists, torch says."""
    import glob
    import os

    import torch

    from engine.config import cuda_available

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(glob, "glob", lambda pattern: [])
    monkeypatch.setattr(os.path, "exists", lambda path: False)
    assert cuda_available() is False
    for present in ("/dev/kfd", "/dev/dxg"):
        monkeypatch.setattr(os.path, "exists", lambda path, present=present: path == present)
        assert cuda_available() is True
    monkeypatch.setattr(os.path, "exists", lambda path: False)
    monkeypatch.setattr(glob, "glob", lambda pattern: ["/dev/nvidia0"])
    assert cuda_available() is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_available() is False
