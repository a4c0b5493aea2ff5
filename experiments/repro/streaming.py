"""The seed's claim measured: streaming each layer's KV while the prefill computes the next hides the link.

1P1D across two hosts (network namespaces, `launcher=netns`, root only) against colocated, with the KV
sent per layer (`transfer.send_mode=layer`), per chunk, or whole after the prefill, over links whose rate
is scaled from real pairs so that the link's time per layer over the compute's time per layer is the
real pair's:

    here rate = real link x (real compute per layer / compute per layer here) x (KV per layer here / real)

The real pair's compute is the simulator's (experiments/sim: the same model on H200s, tp GPUs); here it
is measured before the runs (experiments.capacity: the prompt prefilled by one worker's engine, as the
runs' workers do). Each run is the main job (experiments.run) in this process:

    python -m experiments.repro.streaming --out bench_results/streaming [--model smollm2-135m]
        [--prompt 1536] [--chunk 512] [--requests 8] [--load 0] [--modes layer,chunk,request]
        [--links cx8,cx7,efa,roce100,eth25] [--delay-us 0] [--subnet 1] [--kv-dtypes auto,fp8_e4m3]

--kv-dtypes runs every row once per KV dtype (model.kv_dtype): `auto`, the model's dtype here and bf16 at
real scale; `fp8_e4m3`, e4m3 pages and their scales on both. Each dtype's link rates are scaled with its
own KV bytes (here: the engine's region, scales included; real: one byte an element and the scales), so
a row stands for the same real link in either dtype, and its colocated row (the same KV dtype) is what
its TTFT is set against.

--delay-us is the real pair's one-way delay per link (a host's NIC to the switch; host to host crosses two),
scaled as the rate is, by real compute per layer / compute per layer here, into cluster.link.delay_us.

Writes <out>/<variant>/results.json, <out>/summary.json and <out>/streaming.md (the table, printed too).
Columns: TTFT p50/p90 and its p50 against colocated's; the prefill's compute on the prefill worker (its
first pass began -> its last returned); "KV after prefill" (the last pass returned -> every write landed
on the decode side: what the compute did not hide); "hidden" (1 - that p50 over the whole-request
mode's on the same link: the share of the transfer the mode hid); TPOT p50; bytes the prefill host's
NIC sent over the KV bytes. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir

from engine.role import Role

CONF = str(Path(__file__).resolve().parents[2] / "conf")


@dataclass(frozen=True)
class Pair:
    name: str
    label: str
    bits: float  # the link's bits/s: each GPU's NIC, or (per_node) the node's one link
    per_node: bool = False  # one link for the whole node, whatever the instance's GPUs


# the real pairs the links are scaled from (the instance sends over every GPU's NIC, or the node's one)
PAIRS = {
    "cx8": Pair("cx8", "H200 + 800 Gb/s per GPU (ConnectX-8 class)", 800e9),
    "cx7": Pair("cx7", "H200 + 400 Gb/s ConnectX-7 per GPU", 400e9),
    "efa": Pair("efa", "8 H200 sharing 3.2 Tb/s EFA", 3.2e12 / 8),
    "roce100": Pair("roce100", "H200 + 100 Gb/s per GPU", 100e9),
    "eth25": Pair("eth25", "H200 node + 25 Gb/s Ethernet", 25e9, per_node=True),
}
# our model -> (the simulator's model of the real deployment, its TP on H200s)
REAL = {"smollm2-135m": ("smollm2-135m", 1), "random-deepseek-v3": ("deepseek-r1", 8)}
MODES = ("layer", "chunk", "request")


REAL_PAGE = 16  # the real deployment's page size (its e4m3 scales' share of the KV)


def real_model(model: str, kv_dtype: str = "auto"):
    """The simulator's model of the real deployment, its KV in kv_dtype (auto: as released)."""
    from dataclasses import replace

    from experiments.sim.models import sim_model

    m = sim_model(REAL[model][0])
    if kv_dtype == "fp8_e4m3":  # a byte an element, and a float32 scale per page, plane and head
        width = m.kv_lora_rank + m.rope_dim if m.mla else m.head_dim
        m = replace(m, kv_cache_bytes=1 + 4 / (REAL_PAGE * width))
    return m


def real_layer_s(model: str, prompt: int, kv_dtype: str = "auto") -> tuple[float, float, int]:
    """The real deployment's prefill of one prompt: (seconds per layer, KV bytes per token and layer, TP)."""
    from experiments.sim.cost import CostModel
    from experiments.sim.hardware import hardware

    m, tp = real_model(model, kv_dtype), REAL[model][1]
    cost = CostModel(m, hardware("h200"), tp)
    return cost.prefill_time([prompt]) / m.layers, m.kv_bytes_per_token() / m.layers, tp


def link_rates(
    args, here_layer_s: float, here_kv_layer: float, kv_dtype: str
) -> dict[str, tuple[str, float]]:
    """Each pair's link here: (label, bits/s); pairs that scale to one rate share a run (and a row)."""
    real_s, real_kv, tp = real_layer_s(args.model, args.prompt, kv_dtype)
    out: dict[str, tuple[str, float]] = {}
    for key in args.links:
        pair = PAIRS[key]
        real_bits = pair.bits * (1 if pair.per_node else tp)
        bits = real_bits * (real_s / here_layer_s) * (here_kv_layer / real_kv)
        same = next((k for k, (_, b) in out.items() if abs(b - bits) < 1e-6 * bits), None)
        if same is None:
            out[key] = (pair.label, bits)
        else:
            out[same] = (f"{out[same][0]}; {pair.label}", bits)
    return out


def simulated(args, pairs: list[str], kv_dtype: str) -> list[dict]:
    """The same rows at real scale from the simulator: the real deployment's prefill and decode instances
    (H200s, tp GPUs each) on each pair's link, one request alone, TTFT of colocated and of 1P1D with
    the KV streamed per layer or sent whole (the simulator has no per-chunk mode). The first token is
    sampled on the decode side, as here."""
    from dataclasses import replace

    from experiments.sim.cost import CostModel
    from experiments.sim.hardware import hardware
    from experiments.sim.instance import SimRequest
    from experiments.sim.simulate import Instance, simulate_colocated, simulate_disaggregated

    model, tp, h200 = real_model(args.model, kv_dtype), REAL[args.model][1], hardware("h200")

    def ttft(run) -> float:  # one request alone (a simulated step has no noise: one is every one)
        (r,) = run([SimRequest(0, 0.0, args.prompt, args.output)])
        return r.first_token - r.arrival

    def inst(hw) -> Instance:
        return Instance(CostModel(model, hw, tp), budget=args.chunk)

    rows = [
        {
            "pair": "colocated",
            "mode": None,
            "ttft_p50_s": ttft(lambda r: simulate_colocated([inst(h200)], r)),
        }
    ]
    for key in pairs:
        pair = PAIRS[key]
        hw = replace(h200, nic_bw=pair.bits / 8 / (tp if pair.per_node else 1))
        for mode, layerwise in (("layer", True), ("request", False)):
            t = ttft(
                lambda r, lw=layerwise, hw=hw: simulate_disaggregated(
                    [inst(hw)], [inst(hw)], r, layerwise=lw, first_token_on="decode"
                )
            )
            rows.append({"pair": key, "mode": mode, "ttft_p50_s": t})
    return rows


def tc_rate(bits: float) -> str:
    return f"{max(1, round(bits / 1e3))}kbit"


def summarize(name: str, mode: str | None, link: str | None, record: dict, kv_dtype: str) -> dict:
    s = record["summary"]
    prefill = [w for w in record["workers"] if Role(w["role"]).sends_kv]
    nic = sum(sum(w.get("nic_tx_bytes") or []) for w in prefill)
    return {
        "variant": name,
        "kv_dtype": kv_dtype,
        "mode": mode,
        "link": link,
        "completed": s["completed"],
        "requests": s["num_requests"],
        "ttft_p50_s": s["ttft_s"]["p50"],
        "ttft_p90_s": s["ttft_s"]["p90"],
        "tpot_p50_s": s["tpot_s"]["p50"],
        "compute_p50_s": s["prefill_compute_s"]["p50"],
        "exposed_p50_s": s["kv_exposed_s"]["p50"],
        "exposed_p90_s": s["kv_exposed_s"]["p90"],
        "kv_bytes": s["transfer_bytes"],
        "nic_tx_bytes": nic,
    }


def table(rows: list[dict], rates: dict, here_layer_s: float, kv_layer_bytes: float) -> str:
    base = next((r for r in rows if r["mode"] is None), None)
    whole = {r["link"]: r for r in rows if r["mode"] == "request"}
    lines = [
        "| link (scaled from) | KV | rate here | link/compute per layer | mode | TTFT p50 / p90 ms | vs "
        "colocated p50 ms | prefill compute p50 ms | KV after prefill p50 / p90 ms | hidden | TPOT p50 ms "
        "| KV MB a request | NIC/KV bytes |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def ms(v):
        return "-" if v is None else f"{1e3 * v:.0f}"

    for r in rows:
        if r["mode"] is None:
            label, rate, ratio = "colocated (no transfer)", "-", "-"
        else:
            label, bits = rates[r["link"]]
            rate = f"{bits / 1e6:.1f} Mbit/s"
            ratio = f"{kv_layer_bytes * 8 / bits / here_layer_s:.3g}"
        delta = (
            f"{1e3 * (r['ttft_p50_s'] - base['ttft_p50_s']):+.0f}"
            if base and r is not base and r["ttft_p50_s"] is not None
            else "-"
        )
        ref = whole.get(r["link"])
        hidden = (
            f"{100 * (1 - r['exposed_p50_s'] / ref['exposed_p50_s']):.0f}%"
            if ref and r["exposed_p50_s"] is not None and ref["exposed_p50_s"]
            else "-"
        )
        nic = f"{r['nic_tx_bytes'] / r['kv_bytes']:.3f}" if r["kv_bytes"] else "-"
        lines.append(
            f"| {label} | {r['kv_dtype']} | {rate} | {ratio} | {r['mode'] or '-'} | {ms(r['ttft_p50_s'])} / "
            f"{ms(r['ttft_p90_s'])} | {delta} | {ms(r['compute_p50_s'])} | {ms(r['exposed_p50_s'])} / "
            f"{ms(r['exposed_p90_s'])} | "
            f"{hidden} | {ms(r['tpot_p50_s'])} | {r['kv_bytes'] / max(r['completed'], 1) / 1e6:.2f} | {nic} |"
        )
    return "\n".join(lines)


def sim_table(rows: list[dict]) -> str:
    base = rows[0]["ttft_p50_s"]
    by = {(r["pair"], r["mode"]): r["ttft_p50_s"] for r in rows}
    lines = [
        "| link | colocated TTFT ms | 1P1D per layer ms (vs colocated) | 1P1D whole ms (vs colocated) "
        "| hidden |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for key in dict.fromkeys(r["pair"] for r in rows[1:]):
        layer, whole = by[key, "layer"], by[key, "request"]
        hidden = 1 - (layer - base) / (whole - base) if whole > base else float("nan")
        lines.append(
            f"| {PAIRS[key].label} | {1e3 * base:.2f} | {1e3 * layer:.2f} ({1e3 * (layer - base):+.2f}) | "
            f"{1e3 * whole:.2f} ({1e3 * (whole - base):+.2f}) | {100 * hidden:.0f}% |"
        )
    return "\n".join(lines)


def main() -> None:
    from experiments.run import run as run_job

    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--out", required=True, help="a folder for the runs' results")
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(REAL))
    parser.add_argument("--prompt", type=int, default=1536, help="prompt tokens (every request)")
    parser.add_argument("--output", type=int, default=16, help="output tokens (every request)")
    parser.add_argument("--chunk", type=int, default=512, help="deployment.chunk_size: tokens per pass")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument(
        "--load",
        type=float,
        default=0.0,
        help="Poisson arrivals at this x the slower of one worker's prefill and the link (default: one "
        "request at a time, so that each TTFT is its own prefill and transfer, no queue)",
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--links", default=",".join(PAIRS))
    parser.add_argument("--delay-us", type=float, default=0.0, help="the real one-way delay a link (us)")
    parser.add_argument("--subnet", type=int, default=1, help="cluster.subnet (another run's differs)")
    parser.add_argument("--kv-dtypes", default="auto", help="model.kv_dtype values: every row once in each")
    args = parser.parse_args()
    args.kv_dtypes = [d for d in args.kv_dtypes.split(",") if d]
    args.modes = [m for m in args.modes.split(",") if m]
    args.links = [k for k in args.links.split(",") if k]
    from engine.config import KV_DTYPES

    bad = [m for m in args.modes if m not in MODES] + [k for k in args.links if k not in PAIRS]
    bad += [d for d in args.kv_dtypes if d not in KV_DTYPES]
    if bad:
        parser.error(
            f"unknown {bad}: --modes from {MODES}, --links from {tuple(PAIRS)}, --kv-dtypes from {KV_DTYPES}"
        )
    if args.prompt < 2 or args.chunk < 1 or args.requests < 1 or args.load < 0 or args.delay_us < 0:
        parser.error("--prompt must be >= 2 tokens, --chunk and --requests > 0, --load and --delay-us >= 0")

    base = [
        f"model={args.model}",
        "launcher=netns",
        f"cluster.subnet={args.subnet}",
        f"workload.num_requests={args.requests}",
        f"workload.prompt_len.value={args.prompt}",
        f"workload.output_len.value={args.output}",
        "plots=false",
        "log_level=WARNING",
        "run_timeout_s=3600",
    ]
    chunk = [f"deployment.chunk_size={args.chunk}", "deployment.threads_per_worker=1"]
    out, setups, rows, text = Path(args.out), {}, [], []
    for kv_dtype in args.kv_dtypes:
        dtype_base = [*base, f"model.kv_dtype={kv_dtype}"]
        setup, rates, here_layer_s, kv_prompt = measure_here(args, dtype_base, chunk, kv_dtype)
        setups[kv_dtype] = setup
        kv_request_bits = 8 * kv_prompt

        def arrivals(
            bits: float | None, tokens_s=setup["tokens_s"], kv_request_bits=kv_request_bits
        ) -> list[str]:
            if not args.load:
                return ["workload.arrival=concurrency", "workload.concurrency=1"]
            served = tokens_s / args.prompt
            served = min(served, bits / kv_request_bits) if bits else served
            return ["workload.arrival=poisson", f"workload.rate={args.load * served:.4g}"]

        todo = [
            ("colocated", None, None, ["deployment=colocated", "deployment.num_workers=2", *arrivals(None)])
        ]
        for link, (_, bits) in rates.items():
            for mode in args.modes:
                more = ["deployment=1p1d", f"cluster.link.rate={tc_rate(bits)}", f"transfer.send_mode={mode}"]
                more += [f"cluster.link.delay_us={setup['delay_us']}"]
                more += [f"transfer.peer_timeout_s={setup['peer_timeout_s']}"]
                todo.append((f"1p1d-{mode}-{link}", mode, link, [*more, *arrivals(bits)]))
        dtype_rows = []
        for name, mode, link, overrides in todo:
            with initialize_config_dir(config_dir=CONF, version_base=None):
                cfg = compose("config", overrides=[*dtype_base, *overrides, *chunk])
            (record,) = run_job(cfg, out / kv_dtype / name, progress=False)
            dtype_rows.append(summarize(name, mode, link, record, kv_dtype))
            print(json.dumps(dtype_rows[-1]), flush=True)
        rows += dtype_rows
        part = table(dtype_rows, rates, here_layer_s, setup["kv_layer_bytes"])  # a layer's, of the prompt
        if setup["delay_us"]:
            part += (
                f"\n\nOne-way delay a link: {args.delay_us:g} us there, {setup['delay_us']} us here (host to "
                "host: two).\n"
            )
        real = simulated(args, args.links, kv_dtype)
        part += (
            f"\n\nAt real scale (the simulator, {REAL[args.model][0]} on H200s, TP {REAL[args.model][1]}, KV "
            f"{'bf16 as released' if kv_dtype == 'auto' else kv_dtype}):\n\n"
        )
        text.append(part + sim_table(real))
        (out / f"simulated-{kv_dtype}.json").write_text(json.dumps(real, indent=1))
    (out / "summary.json").write_text(json.dumps({"setup": setups, "rows": rows}, indent=1))
    (out / "streaming.md").write_text("\n\n".join(text) + "\n")
    print("\n\n".join(text))


def here_kv_layer(arch, page_size: int, dtype: str, kv_dtype: str) -> float:
    """KV bytes one token adds to one layer here: the model's dtype, or e4m3's byte an element and its
    float32 scales' share (one per page, plane and head: engine.kv.cache.allocate_scaled_kv_cache)."""
    if kv_dtype == "fp8_e4m3":
        scales = arch.kv_planes * arch.num_kv_heads * 4 / page_size
        return arch.kv_bytes_per_token(1) / arch.num_layers + scales
    return arch.kv_bytes_per_token(4 if dtype == "float32" else 2) / arch.num_layers


def measure_here(args, base: list[str], chunk: list[str], kv_dtype: str):
    """One worker's prefill measured here in this KV dtype, and each pair's link scaled to it: (setup,
    rates, seconds a layer, KV bytes of a prompt)."""
    from experiments.capacity import prefill_tokens_s
    from experiments.config import from_cfg

    with initialize_config_dir(config_dir=CONF, version_base=None):
        probe = from_cfg(compose("config", overrides=[*base, "deployment=1p1d", *chunk]))
    from engine.weights import load_model

    m = probe.model
    arch = load_model(m.name, weights=False).config
    kv_layer = here_kv_layer(arch, m.page_size, m.dtype, kv_dtype)  # per token
    tokens_s = prefill_tokens_s(probe, args.prompt)
    here_layer_s = args.prompt / tokens_s / arch.num_layers
    rates = link_rates(args, here_layer_s, kv_layer, kv_dtype)
    delay_us = round(args.delay_us * here_layer_s / real_layer_s(args.model, args.prompt, kv_dtype)[0])
    kv_prompt = kv_layer * arch.num_layers * args.prompt
    print(
        f"{m.name} ({m.dtype}, KV {kv_dtype}): {tokens_s:.0f} prompt tokens/s here, "
        f"{1e3 * here_layer_s:.1f} ms per layer of a {args.prompt}-token prompt "
        f"({kv_prompt / 1e6:.2f} MB of KV); links: "
        + ", ".join(f"{k} {bits / 1e6:.2f} Mbit/s" for k, (_, bits) in rates.items())
        + f"; {args.delay_us:g} us a link there, {delay_us} us here",
        flush=True,
    )
    setup = {"model": m.name, "dtype": m.dtype, "kv_dtype": kv_dtype, "tokens_s": tokens_s}
    setup |= {"layer_s": here_layer_s, "load": args.load, "prompt": args.prompt, "chunk": args.chunk}
    setup |= {"requests": args.requests, "real_delay_us": args.delay_us, "delay_us": delay_us}
    setup["kv_layer_bytes"] = kv_layer * args.prompt
    # heartbeats go between passes: a pass here may take longer than the default 10 s (a DeepSeek-shaped
    # model's 256 tokens took 13 s on one AVX2 core, and the decode side gave up on a healthy worker)
    setup["peer_timeout_s"] = max(10.0, round(3 * args.chunk / tokens_s, 1))
    setup["links_bits"] = {k: bits for k, (_, bits) in rates.items()}
    return setup, rates, here_layer_s, kv_prompt


if __name__ == "__main__":
    main()
