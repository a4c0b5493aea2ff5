"""KV tiers in the simulator (experiments/sim/instance.py's PageCache with a TierSpec): what a small device
cache evicts comes back from the host pool or files, what one instance computed from the shared pool."""

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.config import workload_of
from experiments.metrics import request_rows, summarize
from experiments.sim.cost import Efficiency
from experiments.sim.hardware import load_hardware
from experiments.sim.instance import TierSpec
from experiments.sim.models import sim_model
from experiments.sim.run import simulate_deployment
from serving.config import deployments_of

CONF = str(Path(__file__).resolve().parents[3] / "conf")
MULTITURN = ["workload=multiturn", "workload.conversations=8", "workload.turns=4", "workload.concurrency=8"]
MULTITURN += ["workload.system_prompt_len=200", "workload.turn_len=100", "workload.output_len.value=40"]


def _sim(routing: str, cache_pages: int, tiers: TierSpec | None, deployment=("deployment=colocated",)):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("config", overrides=[*MULTITURN, *deployment, f"deployment.routing={routing}"])
    plain = OmegaConf.to_container(cfg, resolve=True)
    (d,), workload = deployments_of(plain), workload_of(plain)
    model, hw = sim_model("smollm2-135m"), load_hardware("cpu-epyc-zen4")
    run = simulate_deployment(
        d, workload, model, hw, Efficiency(0.75, 0.75, 0.2), first_token_on="decode", page_size=16,
        cache_pages=cache_pages, tiers=tiers,
    )  # fmt: skip
    return summarize(run, request_rows(run, cfg.slo), cfg.slo, None)


def test_a_small_device_cache_with_a_host_pool_hits_as_a_large_one():
    small, large = _sim("round_robin", 40, None), _sim("round_robin", 4000, None)
    tiered = _sim("round_robin", 40, TierSpec(host_pages=4000))
    assert small["prefix_hit_rate"] < tiered["prefix_hit_rate"] <= large["prefix_hit_rate"] + 1e-9
    assert tiered["kv_tiers"]["host"]["hit_tokens"] > 0
    assert tiered["ttft_s"]["p90"] < small["ttft_s"]["p90"]


def test_files_hold_what_a_small_host_pool_drops():
    host = _sim("round_robin", 40, TierSpec(host_pages=20))
    disk = _sim("round_robin", 40, TierSpec(host_pages=20, disk_pages=4000))
    assert disk["prefix_hit_rate"] > host["prefix_hit_rate"] and disk["kv_tiers"]["disk"]["hit_tokens"] > 0


def test_round_robin_with_the_pool_passes_either_router_without_it():
    aware = _sim("cache_aware", 4000, None)
    rr = _sim("round_robin", 4000, None)
    pooled = _sim("round_robin", 4000, TierSpec(host_pages=64, pool_pages=100_000))
    # every turn finds its whole history wherever it lands: at least what either router keeps local
    assert max(rr["prefix_hit_rate"], aware["prefix_hit_rate"]) < pooled["prefix_hit_rate"]
    assert pooled["kv_tiers"]["pool"]["hit_tokens"] > 0


def test_a_load_from_the_pool_takes_at_most_half_the_host_slots_it_is_staged_through():
    """As engine/kv/tiers.py's load: a pool page lands in a host slot first, and one load takes pool
    pages only while it holds under half of them, so a small host pool caps each turn's pool hits."""
    wide = _sim("round_robin", 4000, TierSpec(host_pages=64, pool_pages=100_000))
    narrow = _sim("round_robin", 4000, TierSpec(host_pages=4, pool_pages=100_000))
    none = _sim("round_robin", 4000, TierSpec(host_pages=1, pool_pages=100_000))  # 0 per load
    assert 0 < narrow["kv_tiers"]["pool"]["hit_tokens"] < wide["kv_tiers"]["pool"]["hit_tokens"]
    assert none["kv_tiers"]["pool"]["hit_tokens"] == 0


def test_a_decode_instance_loads_from_the_pool_as_decode_loads_says_and_puts_nothing_there():
    """1P2D round robin: a turn's decode instance lacks the turns the other one decoded. With `never` it
    is sent them; with `always` it loads the leading pages the pool holds (the prompts the prefill
    instance put there: a decode instance puts nothing, as the engine's decode workers) and is sent
    only the rest; `cost` loads while the loads are quicker than the expected transfer."""
    one_two = ("deployment=1p1d", "deployment.num_decode=2")
    tiers = {m: TierSpec(host_pages=64, pool_pages=100_000, decode_loads=m) for m in ("never", "always")}
    tiers["cost"] = TierSpec(host_pages=64, pool_pages=100_000)  # the default, as the engine's
    runs = {mode: _sim("round_robin", 4000, spec, one_two) for mode, spec in tiers.items()}
    sent = {mode: run["transfer_bytes"] for mode, run in runs.items()}
    assert sent["always"] < sent["never"] and sent["always"] <= sent["cost"] <= sent["never"]
    assert runs["always"]["prefix_hit_rate"] > runs["never"]["prefix_hit_rate"]
    assert all(run["completed"] == 32 for run in runs.values())


def test_the_running_requests_kv_takes_device_pages_from_the_cache_and_its_names_give_them_back():
    """As the engine's one allocator: a 10-page instance whose running requests hold 7 pages the cache
    does not name keeps 3 cached pages (the others go to the host pool), and has room again for those
    pages once they are named: held pages the cache names take no more room."""
    from experiments.sim.cost import CostModel
    from experiments.sim.instance import Instance, SimRequest

    inst = Instance(CostModel(sim_model("smollm2-135m"), load_hardware("cpu-epyc-zen4")), kv_tokens=160)
    inst.enable_cache(tiers=TierSpec(host_pages=100))
    history = SimRequest(0, 0.0, prompt=64, output=1, stream="a")
    inst.cache.add(history, 64, 16)  # 4 pages, no request holds them
    turn = SimRequest(1, 0.0, prompt=80, output=1, stream="a")
    assert inst.cache.peek(turn, 80, 16) == history.names(64, 16)
    inst.running = [SimRequest(2, 0.0, prompt=96, output=2), SimRequest(3, 0.0, prompt=48, output=2)]
    inst.running[0].computed, inst.running[1].computed = 96, 16  # 6 + 1 pages of KV, none named
    inst.fit_cache()
    # its tail leaves first (the engine frees a request's pages last first), to the host pool
    assert list(inst.cache.pages) == history.names(48, 16)[::-1] and inst.cache.capacity == 3
    assert inst.cache.peek(turn, 80, 16) == history.names(64, 16)
    assert inst.cache.lookup(turn, 80, 16) == 4 and inst.cache.tier_hits["host"] == 16
    inst.running[0].named = 96  # its prompt is named: the cache holds its 6 pages beside the others
    inst.fit_cache()
    assert inst.cache.capacity == 9
    inst.cache.add(inst.running[0], 96, 16)
    assert len(inst.cache.pages) == 9


def test_a_prefill_instance_puts_only_the_pages_it_computed_when_decode_runs_the_last_token():
    """As the engine's hand-off: a prefill worker whose decode worker samples the first token computes
    the prompt without its last token, so a 64-token prompt fills 3 of its 4 pages there (the fourth is
    named by neither side's pool puts); when the prefill side samples, it computes all 4."""
    from collections import OrderedDict

    from experiments.sim.cost import CostModel
    from experiments.sim.instance import Instance, SimRequest
    from experiments.sim.simulate import simulate_disaggregated

    cost = CostModel(sim_model("smollm2-135m"), load_hardware("cpu-epyc-zen4"))
    spec = TierSpec(host_pages=8, pool_pages=100)
    for first_token_on, pages in (("decode", 3), ("prefill", 4)):
        pool = OrderedDict()
        prefill, decode = Instance(cost).enable_cache(tiers=spec, pool=pool), Instance(cost).enable_cache()
        (r,) = simulate_disaggregated(
            [prefill], [decode], [SimRequest(0, 0.0, prompt=64, output=2)], first_token_on=first_token_on
        )
        assert r.done is not None and len(pool) == pages
