"""How much a worker's steps slow while another worker computes beside it on this machine, and the
simulator's model of it.

    python -m experiments.sim.contention [--model smollm2-135m] [--rounds 4] [--out FILE]

Two processes of one thread each, as two workers of a deployment run here, pinned to two cores: the
first times the engine's steps (decode steps of several batch sizes at one KV length, and a prompt step),
the second is its neighbour, which in turn idles, runs prompt steps back to back, runs decode steps of a
batch, or streams reads through a buffer far larger than the caches (what competes for memory bandwidth
alone). The modes take turns within each round, so a drift of the machine falls on all of them; each
time is the median of its steps over the rounds.

The model (Contention): a step beside a neighbour's step of kind k (prefill: it holds prompt tokens;
decode) takes 1 + f x memory[k] + (1 - f) x compute[k] times its time alone, f the share of that time
its memory reads take at the machine's read bandwidth (CostModel.step_bytes over a one-thread streaming
read's bytes/s); over a step that a neighbour is busy for only part of, that share of it. memory and
compute are fitted, per neighbour kind, to the steps timed here; --out writes the times and the fit,
which `compare_real --contention` and `calibrate --contention` take.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments.sim.calibrate import bytes_model, nonnegative_lstsq

KINDS = ("prefill", "decode")  # a neighbour's step: with prompt tokens, or decode tokens only


@dataclass(frozen=True)
class Contention:
    """A step's slowdown beside busy neighbours on the same machine (the module's docstring)."""

    memory: dict  # neighbour kind -> the slowdown of a step all of whose time is memory reads
    compute: dict  # neighbour kind -> of a step none of whose time is
    read_bw: float  # bytes/s that f is taken at

    def __post_init__(self):
        for name in ("memory", "compute"):
            table = getattr(self, name)
            if set(table) != set(KINDS) or not all(v >= 0 for v in table.values()):
                raise ValueError(f"contention.{name} must give each of {KINDS} a slowdown >= 0, got {table}")
        if not self.read_bw > 0:
            raise ValueError(f"contention.read_bw must be > 0, got {self.read_bw!r}")

    def share(self, nbytes: float, seconds: float) -> float:
        """f: the share of a step of `seconds` that reading nbytes takes."""
        return min(1.0, nbytes / self.read_bw / seconds) if seconds > 0 else 0.0

    def factor(self, f: float, beside: dict) -> float:
        """How many times its time alone a step takes whose memory share is f, beside neighbours busy
        for the given shares of it, by kind (their sum over neighbours)."""
        return 1.0 + sum(w * (f * self.memory[k] + (1 - f) * self.compute[k]) for k, w in beside.items())

    @staticmethod
    def load(path: Path) -> Contention:
        """The fit a `--out` file holds."""
        fit = json.loads(Path(path).read_text())["fit"]
        return Contention(dict(fit["memory"]), dict(fit["compute"]), float(fit["read_bw"]))


def fit(records: list[dict], model, read_bw: float) -> Contention:
    """memory and compute per neighbour kind, non-negative least squares over the timed steps
    (records: measure's), each step's f from the cost model's bytes and its time alone."""
    cost = bytes_model(model, read_bw)
    probe = Contention(dict.fromkeys(KINDS, 0.0), dict.fromkeys(KINDS, 0.0), read_bw)
    shares = np.array([probe.share(step_bytes(cost, r), r["alone"]) for r in records])
    memory, compute = {}, {}
    for kind in KINDS:
        slow = np.array([r["beside"][kind] / r["alone"] - 1 for r in records])
        memory[kind], compute[kind] = nonnegative_lstsq(np.stack([shares, 1 - shares], axis=1), slow)
    return Contention(memory, compute, read_bw)


def step_bytes(cost, record: dict) -> float:
    """The bytes a timed step reads (CostModel.step_bytes of its shape)."""
    if record["kind"] == "decode":
        return cost.step_bytes([], [record["kv"]] * record["size"])
    return cost.step_bytes([(record["size"], 0)], [], sampled=1)


MODES = ("idle", "prefill", "decode", "read")  # the neighbour's, in the order each round takes them
MAX_TOKENS = 1 << 10  # a decoding sequence's: more than the steps timed (the batch must not shrink)


@dataclass(frozen=True)
class Shapes:
    """What the bench times: the victim's decode batches at kv tokens each and its prompt steps of prompt
    tokens; the neighbour's prompts of prompt tokens and its decode batch at kv."""

    batches: tuple = (1, 8, 32)
    kv: int = 1024
    prompt: int = 1024
    neighbour_batch: int = 16
    pages: int = 6144  # each engine's (16-token pages): the largest batch, each with MAX_TOKENS outputs


def _engine(model: str, shapes: Shapes):
    import torch

    from engine import LLM
    from pdkernels import ops

    torch.set_num_threads(1)
    ops.set_backend("torch")
    # no prefix cache: every prompt step computes its whole prompt
    return LLM(
        model, num_pages=shapes.pages, max_num_batched_tokens=shapes.prompt, enable_prefix_caching=False
    )


def _decoding(llm, b: int, kv: int) -> list[str]:
    """b requests of kv prompt tokens, each decoding once every prompt is in."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [llm.add_request(list(range(100 + i, 100 + i + kv)), params) for i in range(b)]
    prompting = set(ids)
    while prompting:
        prompting -= {o.request_id for o in llm.step() if o.token_ids}
    return ids


def _done(llm, ids: list[str]) -> None:
    for rid in ids:
        llm.abort(rid)
    while llm.has_unfinished():
        llm.step()


def _prompt_step(llm, tokens: int, n: int = 0) -> None:
    """One step computing a prompt of `tokens` (a different one each n: nothing is reused)."""
    from engine import SamplingParams

    first = 200 + n % 50
    llm.add_request(list(range(first, first + tokens)), SamplingParams(max_tokens=1, ignore_eos=True))
    llm.step()


def _neighbour(model: str, shapes: Shapes, core: int, conn) -> None:
    """The neighbour: told a mode, it acknowledges once it runs it, and runs it until told another. Its
    decoding batch is one engine's, prompted once and kept across modes; its prompt steps another's."""
    import torch

    os.sched_setaffinity(0, {core})
    prompts, decoder = _engine(model, shapes), _engine(model, shapes)
    _decoding(decoder, shapes.neighbour_batch, shapes.kv)
    hog = torch.ones(64 << 20, dtype=torch.float32)  # 256 MB: far past any cache
    conn.send("ready")
    mode, n = "idle", 0
    while True:
        if mode == "idle" or conn.poll(0):
            mode = conn.recv()
            if mode == "stop":
                return
            conn.send(mode)  # acknowledged: it runs this mode from now on
            continue
        if mode == "prefill":
            _prompt_step(prompts, shapes.prompt, n)
        elif mode == "decode":
            decoder.step()
            if not decoder.has_unfinished():
                _decoding(decoder, shapes.neighbour_batch, shapes.kv)
        else:  # read
            hog.sum()
        n += 1


def measure(
    model: str = "smollm2-135m", shapes: Shapes = Shapes(), rounds: int = 4, steps: int = 6
) -> list[dict]:
    """The victim's steps: [{kind, size, kv, alone: s, beside: {mode: s}}], each the median over the
    rounds, beside each busy mode of the neighbour."""
    import multiprocessing as mp

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise RuntimeError(f"two cores are needed (one for each worker), this process may use {cores}")
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_neighbour, args=(model, shapes, cores[1], theirs), daemon=True)
    proc.start()
    try:
        os.sched_setaffinity(0, {cores[0]})
        llm = _engine(model, shapes)

        def answer(want: str) -> None:
            """The neighbour's next word, which must be want; its death or 600 s of silence raise."""
            give_up = time.monotonic() + 600
            while not mine.poll(0.2):
                if not proc.is_alive() or time.monotonic() > give_up:
                    raise RuntimeError(f"the neighbour did not say {want!r} (exit code {proc.exitcode})")
            if mine.recv() != want:
                raise RuntimeError(f"the neighbour did not say {want!r}")

        answer("ready")

        def beside(mode: str) -> None:
            mine.send(mode)
            answer(mode)

        def timed(step, key: tuple, times: dict, n: int) -> None:
            for mode in MODES:
                beside(mode)
                for i in range(n):
                    t = time.perf_counter()
                    step(i)
                    times.setdefault(key, {}).setdefault(mode, []).append(time.perf_counter() - t)

        times: dict[tuple, dict[str, list[float]]] = {}
        for b in shapes.batches:
            print(f"timing decode steps of {b} x {shapes.kv} tokens ...", file=sys.stderr, flush=True)
            ids = _decoding(llm, b, shapes.kv)
            for _ in range(rounds):
                timed(lambda i: llm.step(), ("decode", b, shapes.kv), times, steps)
            _done(llm, ids)
        print(f"timing prompt steps of {shapes.prompt} tokens ...", file=sys.stderr, flush=True)
        for r in range(rounds):
            timed(lambda i, r=r: _prompt_step(llm, shapes.prompt, 7 * r + i), ("prefill", shapes.prompt, 0),
                  times, max(2, steps // 2))  # fmt: skip
        mine.send("stop")
        proc.join(timeout=60)
    finally:
        os.sched_setaffinity(0, cores)  # this process's cores again
        if proc.is_alive():
            proc.kill()
    return [
        {
            "kind": kind,
            "size": size,
            "kv": kv,
            "alone": statistics.median(by["idle"]),
            "beside": {m: statistics.median(by[m]) for m in MODES if m != "idle"},
        }
        for (kind, size, kv), by in times.items()
    ]


def read_bandwidth() -> float:
    """A one-thread streaming read's bytes/s (hardware.measure's), as the workers' cores see it."""
    from experiments.sim.hardware import measure as measure_machine

    return measure_machine(1, "cpu", "float32").read_bw


def main(argv=None) -> int:
    from experiments.sim.hardware import cpu_model
    from experiments.sim.models import sim_model
    from pdkernels.cpuinfo import isa

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, help="write the times and the fit here as JSON")
    args = ap.parse_args(argv)
    read_bw = read_bandwidth()
    records = measure(args.model, rounds=args.rounds)
    model = sim_model(args.model)
    got = fit(records, model, read_bw)
    print(f"{cpu_model()} ({isa()}), one thread's streaming read {read_bw / 1e9:.1f} GB/s")
    busy = [m for m in MODES if m != "idle"]
    print(f"{'step':<22} {'alone ms':>9} {'f':>5} " + " ".join(f"{'+' + m + ' %':>10}" for m in busy)
          + " " + " ".join(f"{'model ' + k + ' %':>16}" for k in KINDS))  # fmt: skip
    cost = bytes_model(model, read_bw)
    for r in records:
        f = got.share(step_bytes(cost, r), r["alone"])
        label = f"{r['kind']} {r['size']}" + (f" x kv {r['kv']}" if r["kind"] == "decode" else "")
        cells = " ".join(f"{100 * (r['beside'][m] / r['alone'] - 1):>10.1f}" for m in busy)
        model_cells = " ".join(f"{100 * (got.factor(f, {k: 1.0}) - 1):>16.1f}" for k in KINDS)
        print(f"{label:<22} {1e3 * r['alone']:>9.1f} {f:>5.2f} {cells} {model_cells}")
    print("fit: memory " + ", ".join(f"{k} {v:.3f}" for k, v in got.memory.items())
          + "; compute " + ", ".join(f"{k} {v:.3f}" for k, v in got.compute.items()))  # fmt: skip
    if args.out:
        fitted = {"memory": got.memory, "compute": got.compute, "read_bw": read_bw}
        out = {"cpu": cpu_model(), "isa": isa(), "model": args.model, "records": records, "fit": fitted}
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
