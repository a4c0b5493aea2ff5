"""Fit the cost model's efficiency factors to step times measured on the real engine here.

    python -m experiments.sim.calibrate [--model smollm2-135m] [--threads 1] [--out EFF.json]
    python -m experiments.sim.calibrate --model random-deepseek-v3 --device cuda --hardware h200 --out F
    python -m experiments.sim.calibrate --from-run RUN/results.json [--hardware cpu-this-machine]

1. Measure this machine as the cost model sees a device, with the worker's thread count: bf16 matmul
   FLOP/s and memory copy bandwidth (a Hardware preset with source "measured here"); or, with
   --hardware, fit against a preset's datasheet peaks (what the simulator's studies use).
2. Time real forward passes of the engine: prefills of several prompt lengths and decode steps of
   several batch sizes (best of a few). Or, with --from-run, take the steps a real serving run timed
   inside its workers (results.json "timelines": the same model, workload and deployment, with the
   worker loop, the messenger's thread and the other processes around it), the median of each shape
   (a step's prompt chunks and the cached prefix each attends over, where the timeline records them).
3. Fit linear/attention efficiency, memory efficiency and a fixed per-step overhead by least squares on
   the relative error (a grid; the roofline's max() rules out a closed form), and print each point's
   measured and fitted time. From a run with a disaggregated deployment, also the hand-off: how long a
   request takes from arriving to its prefill starting on the prefill worker (the decode worker and the
   messenger's PrefillRequest in between), the median over its requests.
The fitted factors go into conf/sim.yaml's `efficiency` (with `hardware` set to this machine's preset),
the hand-off into `handoff_s`, to simulate the real deployments; --out writes them as JSON, which the
large-MoE study takes with --efficiency (experiments/repro/moe_study.py). --model takes any model the
engine loads (the MoE and MLA shapes too: tiny-random-deepseek, random-deepseek-v3), its cost-model view
built from the engine's own config (experiments.sim.models.from_engine).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.role import Role
from experiments.sim.cost import CostModel, Efficiency
from experiments.sim.hardware import Hardware, load_hardware, measure
from experiments.sim.models import sim_model


@dataclass(frozen=True)
class Point:
    kind: str  # prefill | decode
    size: int  # prompt tokens, or decode batch size
    kv: int  # decode: KV length per sequence
    seconds: float
    decode: int = 0  # prefill: decode sequences in the same step (a mixed step)
    prompt: int = 0  # prefill: a step's prompt tokens are chunks of at most this many (0: one chunk)
    given: tuple = ()  # prefill: the step's chunks (new tokens, prefix) as its worker recorded them

    @property
    def chunks(self) -> list[tuple[int, int]]:
        """The step's prefill chunks (new tokens, prefix): as recorded, or, from a timeline without them,
        its tokens cut into whole prompts of `prompt` tokens and the rest, as a step of a run whose
        prompts are about that long holds them (a 2,048-token step of 1,024-token prompts is two prompts,
        whose attention is half of one 2,048-token prompt's), each piece's prefix taken as none."""
        if self.kind != "prefill":
            return []
        if self.given:
            return list(self.given)
        whole, rest = divmod(self.size, self.prompt) if self.prompt else (0, self.size)
        return [(self.prompt, 0)] * whole + ([(rest, 0)] if rest else [])

    @property
    def seqs(self) -> int:
        """Sequences in the step."""
        return len(self.chunks) + self.decode if self.kind == "prefill" else self.size

    def label(self) -> str:
        if self.kind == "prefill":
            return f"prefill {self.size}" + (f" + decode {self.decode}" if self.decode else "")
        return f"decode {self.size} x kv {self.kv}"


def predict(cost: CostModel, p: Point) -> float:
    if p.kind == "prefill":
        return cost.step_time(p.chunks, [p.kv] * p.decode, sampled=1 + p.decode)
    return cost.decode_time([p.kv] * p.size)


PREFIX_BIN = 128  # a recorded chunk's prefix, to the nearest this many tokens (a shape's steps: one median)


def points_from_run(
    saved: dict, roles=("colocated", "decode", "prefill"), contention=None
) -> tuple[list[Point], list[str]]:
    """The steps a real run's TP-1 workers of the given roles timed, grouped by shape (prefill tokens,
    decode batch, its prompt chunks and its decode sequences' mean KV where the timeline recorded them,
    prefixes and KV to PREFIX_BIN tokens), the median of each. Without a recorded KV, a decode
    sequence's is the requests' mean prompt plus half their mean output (in a multiturn run the early
    turns' steps then read as too slow for their KV and the late ones' as too fast); without recorded
    chunks a step's prompt tokens are chunks of at most their mean prompt (Point.chunks). contention (a
    Contention): each step's time is taken back to what it would be alone, by the other workers' steps
    beside it in the same run (alone()). Returns the points and what was left out."""
    reqs = [r for rec in saved["runs"] for r in rec["requests"]]
    kv = int(np.mean([r["prompt_tokens"] + r["output_tokens"] / 2 for r in reqs]))
    prompt = round(np.mean([r["prompt_tokens"] for r in reqs]))
    deployments = {d["name"]: d for d in saved["config"]["deployments"]}
    shapes: dict[tuple, list[float]] = {}
    skipped = []
    bytes_of = _reads(saved, contention)
    for rec in saved["runs"]:
        d = deployments[rec["deployment"]]
        for t in rec["timelines"]:
            if t["role"] not in roles:
                continue
            others = [u["steps"] for u in rec["timelines"] if u is not t]
            role = Role(t["role"])
            tp = d[f"{role}_tp"] if role.sends_kv or role.receives_kv else d["tp"]
            if tp != 1:
                skipped.append(f"{rec['deployment']}/{t['name']} (TP {tp})")
                continue
            for start, end, prefill, decode, *rest in t["steps"]:
                given = tuple((n, PREFIX_BIN * round(p / PREFIX_BIN)) for n, p in rest[1]) if rest[1:] else ()
                seq_kv = kv
                if rest[2:] and decode:  # recorded: the decode sequences' mean, binned
                    seq_kv = max(1, PREFIX_BIN * round(rest[2] / decode / PREFIX_BIN))
                seconds = end - start
                if contention is not None:
                    chunks = list(given) or [(prefill, 0)] * bool(prefill)
                    nbytes = bytes_of.step_bytes(chunks, [seq_kv] * decode, decode + bool(prefill))
                    seconds = alone(contention, nbytes, start, end, others)
                shapes.setdefault((prefill, decode, given, seq_kv), []).append(seconds)
    points = []
    for (prefill, decode, given, seq_kv), secs in sorted(shapes.items()):
        med = float(np.median(secs))
        if prefill:
            points.append(Point("prefill", prefill, seq_kv, med, decode=decode, prompt=prompt, given=given))
        else:
            points.append(Point("decode", decode, seq_kv, med))
    return points, skipped


def _reads(saved: dict, contention):
    """A cost model of the run's model, for what its steps read (only with contention)."""
    if contention is None:
        return None
    return bytes_model(sim_model(saved["config"]["model"]["name"]), contention.read_bw)


def bytes_model(model, read_bw: float) -> CostModel:
    """A cost model of one rank, for its step_bytes (its times are not used)."""
    hw = Hardware("here", 1.0, read_bw, 1.0, 1.0, 1.0, devices_per_node=1)
    return CostModel(model, hw, 1, Efficiency())


def alone(contention, nbytes: float, start: float, end: float, others: list[list]) -> float:
    """A step's time with its neighbours' cost taken out: the steps of the other workers (others: their
    timelines' steps) that overlap [start, end], by kind and share of it, priced by contention; its memory
    share f is its time alone's, found by iterating from the measured time's."""
    seconds = end - start
    shares: dict[str, float] = {}
    for steps in others:
        for s0, s1, prefill, *_ in steps:
            overlap = min(end, s1) - max(start, s0)
            if overlap > 0 and seconds > 0:
                kind = "prefill" if prefill else "decode"
                shares[kind] = shares.get(kind, 0.0) + overlap / seconds
    if not shares:
        return seconds
    t = seconds
    for _ in range(4):
        t = seconds / contention.factor(contention.share(nbytes, t), shares)
    return t


def calibrate_from_run(saved: dict, hw: Hardware, allow_bound: bool = False, contention=None) -> dict:
    """Fit the efficiency to the colocated and decode workers' steps; then how much longer the prefill
    workers' steps take than that model says (median ratio: on a CPU the messenger's thread and the
    NIXL posts share the prefill worker's core); and the hand-off. allow_bound: as fit's. contention: the
    steps' times alone are fitted (points_from_run), for a simulation that prices the neighbours."""
    model = sim_model(saved["config"]["model"]["name"])
    points, skipped = points_from_run(saved, roles=("colocated", "decode"), contention=contention)
    if not points:
        raise ValueError(f"no steps of TP-1 colocated or decode workers to fit (left out: {skipped})")
    eff, err = fit(model, hw, points, allow_bound=allow_bound)
    cost = CostModel(model, hw, 1, eff)
    prefill_points, more = points_from_run(saved, roles=("prefill",), contention=contention)
    ratios = [p.seconds / predict(cost, p) for p in prefill_points]
    return {
        "model": model,
        "efficiency": eff,
        "rms": err**0.5,
        "points": points,
        "prefill_points": prefill_points,
        "prefill_slowdown": float(np.median(ratios)) if ratios else 1.0,
        "handoff_s": handoff_from_run(saved),
        "skipped": skipped + more,
    }


def handoff_from_run(saved: dict) -> float | None:
    """Median time from a remotely prefilled request's arrival to the start of the first step of its
    prefill worker at or after it (exact when requests do not overlap, as under concurrency 1)."""
    gaps = []
    for rec in saved["runs"]:
        steps = {
            t["name"]: sorted(s[0] for s in t["steps"] if s[2] > 0)
            for t in rec["timelines"]
            if Role(t["role"]).sends_kv
        }
        for r in rec["requests"]:
            starts = steps.get(r.get("prefill_worker") or "", [])
            later = [s for s in starts if s >= r["arrival_s"]]
            if r["prefill"] == "remote" and later:
                gaps.append(later[0] - r["arrival_s"])
    return float(np.median(gaps)) if gaps else None


# the linear and memory efficiencies fit() tries: steps of 0.05, and below 0.05 down to 0.01 (a small
# model's GEMMs reach a few percent of an AMX core's peak)
GRID = np.concatenate([[0.01, 0.02, 0.03, 0.04], np.linspace(0.05, 1.0, 20)])


class FitAtBound(ValueError):
    """A fitted efficiency sits on its grid's bound: the machine model does not describe the steps."""


def at_bound(eff: Efficiency) -> list[str]:
    """The fitted factors that sit on a bound of GRID, as 'linear 1.00 (its upper bound)'."""
    out = []
    for name in ("linear", "memory"):
        v = getattr(eff, name)
        if np.isclose(v, GRID[-1]) or np.isclose(v, GRID[0]):
            out.append(f"{name} {v:.2f} (its {'upper' if np.isclose(v, GRID[-1]) else 'lower'} bound)")
    return out


def fit(
    model, hw: Hardware, points: list[Point], tp: int = 1, allow_bound: bool = False
) -> tuple[Efficiency, float]:
    """Efficiency minimising the mean squared relative error over points; returns it and that error.

    A grid over the linear (= attention) and memory efficiencies; for each, the best step overhead a and
    per-sequence overhead b are a weighted linear least squares (weights 1 / measured^2, the relative
    error): minimise sum(((pred + a + b x seqs - meas) / meas)^2) with a, b >= 0. A factor that lands on
    the grid's bound (the steps ran faster than the machine model's peak allows, or far slower) raises
    FitAtBound naming it and the machine model, unless allow_bound (the caller then says so itself)."""
    meas = np.array([p.seconds for p in points])
    seqs = np.array([p.seqs for p in points], dtype=float)
    sw = 1 / meas
    best = (np.inf, None)
    for lin, mem in itertools.product(GRID, GRID):
        base = Efficiency(linear=float(lin), attention=float(lin), memory=float(mem))
        preds = np.array([predict(CostModel(model, hw, tp, base), p) for p in points])
        a, b = _overheads(meas - preds, seqs, sw)
        err = float(np.mean(((preds + a + b * seqs - meas) * sw) ** 2))
        if err < best[0]:
            best = (err, Efficiency(float(lin), float(lin), float(mem), step_overhead_s=a, seq_overhead_s=b))
    bound = at_bound(best[1])
    if bound and not allow_bound:
        raise FitAtBound(
            f"the fitted {' and '.join(bound)} sits on the grid's bound [{GRID[0]:.2f}, {GRID[-1]:.2f}]: the "
            f"machine model {hw.name} ({hw.flops / 1e9:,.0f} GFLOP/s, {hw.hbm_bw / 1e9:.1f} GB/s; "
            f"{hw.source}) does not describe these steps. Fit against the machine that ran them (hardware "
            "cpu-this-machine measures the one you are on; a recorded run wants the figures of the machine "
            "that recorded it)"
        )
    return best[1], best[0]


def _overheads(resid: np.ndarray, seqs: np.ndarray, sw: np.ndarray) -> tuple[float, float]:
    """Non-negative (a, b) minimising sum(((a + b x seqs - resid) x sw)^2)."""
    return nonnegative_lstsq(np.stack([sw, seqs * sw], axis=1), resid * sw)


def nonnegative_lstsq(cols: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """argmin |cols x - y| over x >= 0, for two columns: the unconstrained solution if both are >= 0,
    else the better of each column alone (clamped at 0; the first on a tie)."""
    x, *_ = np.linalg.lstsq(cols, y, rcond=None)
    if (x >= 0).all():
        return float(x[0]), float(x[1])
    alone = [max(0.0, float(cols[:, c] @ y / (cols[:, c] @ cols[:, c]))) for c in range(2)]
    cost = [float(np.sum((cols[:, c] * alone[c] - y) ** 2)) for c in range(2)]
    return (alone[0], 0.0) if cost[0] <= cost[1] else (0.0, alone[1])


def _collective_rank(rank: int, ranks: int, rendezvous: str, hidden: int, rounds: int, out) -> None:
    import os
    import statistics

    import torch
    import torch.distributed as dist

    from engine.collectives import all_sum

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=ranks)
    x, rows = torch.randn(16, hidden), torch.randn(16 * ranks, hidden + 1)
    got, split = torch.empty_like(rows), [16] * ranks

    def median(fn) -> float:
        for _ in range(10):
            fn()
        times = []
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    try:
        result = (median(lambda: all_sum(x)), median(lambda: dist.all_to_all_single(got, rows, split, split)))
        if rank == 0:
            out.put(result)
    finally:
        dist.destroy_process_group()


def measure_collectives(ranks: int = 2, hidden: int = 128, rounds: int = 200) -> tuple[float, float]:
    """(one all-reduce, one all-to-all exchange): the median latency of the engine's own collectives
    (engine.collectives.all_sum of a [16, hidden] tensor; all_to_all_single of 16 rows of hidden + 1 to
    each rank) between `ranks` processes of one thread on this machine, over gloo as the engine's CPU
    ranks use it: Hardware.allreduce_s and alltoall_s."""
    import os
    import shutil
    import tempfile

    import torch.multiprocessing as mp

    folder = tempfile.mkdtemp(prefix="pdk-collectives-")
    try:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        rendezvous = os.path.join(folder, "rendezvous")
        args = [(r, ranks, rendezvous, hidden, rounds, out) for r in range(ranks)]
        procs = [ctx.Process(target=_collective_rank, args=a, daemon=True) for a in args]
        for p in procs:
            p.start()
        result = out.get(timeout=120)
        for p in procs:
            p.join(timeout=30)
        return result
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def measure_engine(
    model_name: str,
    threads: int,
    prompts=(32, 128, 512),
    batches=(1, 8, 32),
    kv=128,
    device: str = "cpu",
    dtype: str = "bfloat16",
    mixed: int = 0,
) -> list[Point]:
    """Best-of-3 step times of the engine on this device: one prefill of each prompt length, then decode
    steps of each batch size at KV length about kv (the step returns its sampled tokens, so a GPU's work
    is done when it returns); with mixed, also the longest prompt's prefill in the step of that many
    decoding sequences (a colocated worker's step under load)."""
    import torch

    from engine import LLM, SamplingParams
    from pdkernels import ops

    torch.set_num_threads(threads)
    ops.set_backend("torch" if device == "cpu" else "auto")
    longest = max(prompts)
    pages = max(512, -(-longest // 16) + (max(batches) + mixed) * (-(-(kv + 16) // 16)) + 64)
    # no prefix cache: every timed prefill computes its whole prompt (the same prompt again would be a hit)
    llm = LLM(model_name, device=device, dtype=dtype, num_pages=pages, max_num_batched_tokens=longest + mixed,
              enable_prefix_caching=False)  # fmt: skip
    points = []
    for n in prompts:
        times = []
        for _ in range(3):
            llm.add_request(list(range(100, 100 + n)), SamplingParams(max_tokens=1, ignore_eos=True))
            t = time.perf_counter()
            llm.step()
            times.append(time.perf_counter() - t)
        points.append(Point("prefill", n, 0, min(times)))

    def decoding(b: int) -> list[str]:
        """b requests of kv prompt tokens, each decoding once every prompt is in (more tokens asked than
        the steps that take: a request that finished would shrink the batch being timed)."""
        ids = [
            llm.add_request(list(range(100, 100 + kv)), SamplingParams(max_tokens=1 << 12, ignore_eos=True))
            for _ in range(b)
        ]
        prompting = set(ids)
        while prompting:  # the prompts (they sample their first token)
            prompting -= {o.request_id for o in llm.step() if o.token_ids}
        return ids

    def done(ids: list[str]) -> None:
        for rid in ids:
            llm.abort(rid)
        while llm.has_unfinished():
            llm.step()

    for b in batches:
        ids = decoding(b)
        times = []
        for _ in range(4):
            t = time.perf_counter()
            llm.step()
            times.append(time.perf_counter() - t)
        done(ids)
        points.append(Point("decode", b, kv + 3, min(times)))
    if mixed:
        ids = decoding(mixed)
        times = []
        for _ in range(3):  # the whole prompt and every decode in one step (the budget holds them)
            rid = llm.add_request(
                list(range(100, 100 + longest)), SamplingParams(max_tokens=1, ignore_eos=True)
            )
            t = time.perf_counter()
            out = llm.step()
            times.append(time.perf_counter() - t)
            if not any(o.request_id == rid and o.token_ids for o in out):
                raise RuntimeError(
                    f"the {longest}-token prompt was not prefilled in one step beside {mixed} decodes"
                )
        points.append(Point("prefill", longest, kv + 4, min(times), decode=mixed))
        done(ids)
    return points


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--from-run", type=Path, help="a real run's results.json: fit its workers' steps")
    ap.add_argument(
        "--hardware",
        default=None,
        help="conf/hardware/ file to fit against (default: cpu-this-machine with --from-run, else measured)",
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the engine's steps are timed")
    ap.add_argument("--out", type=Path, help="write the fitted efficiency (and the points) here as JSON")
    ap.add_argument(
        "--allow-bound",
        action="store_true",
        help="keep a fit whose factor sits on the grid's bound (printed as such) instead of refusing it",
    )
    args = ap.parse_args(argv)
    if args.from_run:
        hw = load_hardware(args.hardware or "cpu-this-machine")
        try:
            cal = calibrate_from_run(json.loads(args.from_run.read_text()), hw, allow_bound=args.allow_bound)
        except FitAtBound as e:
            ap.error(str(e))
        model, eff, err, points = cal["model"], cal["efficiency"], cal["rms"] ** 2, cal["points"]
        print(f"{args.from_run}: {len(points)} step shapes of colocated and decode workers"
              + (f" (left out: {', '.join(cal['skipped'])})" if cal["skipped"] else ""))  # fmt: skip
    else:
        hw = load_hardware(args.hardware) if args.hardware else measure(args.threads, args.device)
        print(
            f"{hw.name} ({hw.source or 'preset'}), {args.threads} thread(s): {hw.flops / 1e9:.0f} GFLOP/s "
            f"bf16 matmul, {hw.hbm_bw / 1e9:.1f} GB/s copy"
        )
        model = sim_model(args.model)
        points = measure_engine(args.model, args.threads, device=args.device)
        try:
            eff, err = fit(model, hw, points, allow_bound=args.allow_bound)
        except FitAtBound as e:
            ap.error(str(e))
    if at_bound(eff):
        print(f"warning: the fit sits on its grid's bound ({', '.join(at_bound(eff))}): read it with care")
    print(
        f"fitted: linear/attention {eff.linear:.2f}, memory {eff.memory:.2f}, step overhead "
        f"{1e3 * eff.step_overhead_s:.1f} ms, per-sequence overhead {1e3 * eff.seq_overhead_s:.2f} ms "
        f"(rms relative error {100 * err**0.5:.1f}%)"
    )
    cost = CostModel(model, hw, 1, eff)
    print(f"{'step':<26}{'measured ms':>12}{'model ms':>10}{'error':>8}")
    for p in points:
        pred = predict(cost, p)
        print(
            f"{p.label():<26}{1e3 * p.seconds:>12.1f}{1e3 * pred:>10.1f}{100 * (pred / p.seconds - 1):>7.0f}%"
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "model": model.name,
                    "hardware": hw.name,
                    "device": args.device,
                    "efficiency": dataclasses.asdict(eff),
                    "rms_relative_error": err**0.5,
                    "points": [
                        {"step": p.label(), "measured_s": p.seconds, "model_s": predict(cost, p)}
                        for p in points
                    ],
                },
                indent=2,
            )
        )
        print(f"wrote {args.out}")
    if args.from_run:
        for p in cal["prefill_points"]:
            print(f"prefill worker: {p.label():<18}{1e3 * p.seconds:>10.1f} ms measured, "
                  f"{1e3 * predict(cost, p):.1f} ms modelled")  # fmt: skip
        print(f"prefill worker slowdown (median measured / modelled): {cal['prefill_slowdown']:.2f}")
        if cal["handoff_s"] is not None:
            print(f"hand-off (arrival -> its prefill starts on the prefill worker), median: "
                  f"{1e3 * cal['handoff_s']:.1f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
