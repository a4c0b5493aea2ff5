"""Requests of a workload: when each arrives, its prompt tokens and how many tokens it generates.

Datasets: `random` (random token ids, as vLLM's and SGLang's random datasets, or the lines of a
prompts_file), `sharegpt` (a ShareGPT JSON file: each conversation's first turn is the prompt, the
token count of the reply is the output length, as vLLM's benchmark samples it) and `mooncake` (a
Mooncake trace, JSON lines of timestamp in ms, input_length, output_length and hash_ids: the prompt is
built block by block, 512 tokens per hash id, so requests that share hash ids share a prefix;
replayed on its timestamps unless `arrival` says otherwise; a line that is not such an object is refused
naming its line number and field). The simulator draws the same lengths and arrivals.
`multiturn` is a closed loop (`Conversations`): each conversation's first turn arrives on the workload's
schedule; each later turn's prompt is the previous prompt, the reply the server returned and a new user
message, and it arrives think_time_s after that reply ended: the KV reuse of chat and agent traffic.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np

from experiments.config import LengthDist, WorkloadConfig
from experiments.record import Request


class Conversations:
    """The multiturn workload: `conversations` conversations of up to `turns` turns over one shared
    system prompt of `system_prompt_len` tokens. Turn t's user message (turn_len tokens) and reply length
    (output_len) are drawn from the seed and (conversation, t), so every deployment gets the same ones;
    or, with a ShareGPT file as dataset_path, they are its conversations' human messages and the token
    counts of their replies (each conversation once, in a seeded order, before any repeats; as many turns
    as it has, up to `turns`). The reply itself is whatever the server returned. A conversation ends early
    when its next prompt and reply would not fit the context."""

    def __init__(self, workload: WorkloadConfig, vocab_size: int, max_position: int, tokenizer=None):
        self.workload, self.vocab_size, self.max_position = workload, vocab_size, max_position
        rng = np.random.default_rng([workload.seed, 4])
        self.system = rng.integers(3, vocab_size, workload.system_prompt_len).tolist()
        self.chats: list[list[tuple[list[int], int]]] | None = None  # ShareGPT: (message ids, reply len)
        if workload.dataset_path is not None:
            if tokenizer is None:
                raise ValueError("a multiturn workload from a ShareGPT file needs the model's tokenizer")
            self.chats = _sharegpt_chats(workload, tokenizer)

    def _message(self, conversation: int, turn: int) -> tuple[list[int], int] | None:
        """Turn's user message ids and reply length (None: the conversation has no such turn)."""
        w = self.workload
        if turn >= w.turns:
            return None
        if self.chats is not None:
            chat = self.chats[conversation % len(self.chats)]
            return chat[turn] if turn < len(chat) else None
        rng = np.random.default_rng([w.seed, 5, conversation, turn])
        reply = sample_lengths(w.output_len, 1, rng, cap=self.max_position // 2)[0]
        return rng.integers(3, self.vocab_size, w.turn_len).tolist(), reply

    def first(self) -> list[Request]:
        """Every conversation's first turn, arriving on the workload's schedule."""
        w = self.workload
        arrivals = _arrivals(replace(w, num_requests=w.conversations))
        out = []
        for c in range(w.conversations):
            message, reply = self._message(c, 0)
            prompt = self.system + list(message)
            if len(prompt) + reply < self.max_position:
                out.append(Request(f"conv{c}-turn0", float(arrivals[c]), prompt, reply, c, 0))
        return out

    def next(self, request: Request, reply_ids: list[int], ended_s: float) -> Request | None:
        """The turn after request, whose reply (reply_ids) ended at ended_s (offset from the run's start);
        None when the conversation is over."""
        c, t = request.conversation, request.turn + 1
        turn = self._message(c, t) if c >= 0 else None
        if turn is None:
            return None
        message, reply = turn
        prompt = list(request.prompt_ids) + list(reply_ids) + list(message)
        if len(prompt) + reply >= self.max_position:
            return None
        return Request(f"conv{c}-turn{t}", ended_s + self.workload.think_time_s, prompt, reply, c, t)


def sample_lengths(dist: LengthDist, n: int, rng: np.random.Generator, cap: int) -> list[int]:
    if dist.kind == "fixed":
        out = np.full(n, dist.value)
    elif dist.kind == "uniform":
        out = rng.integers(dist.low, dist.high + 1, n)
    else:  # log-normal with the given mean (in tokens) and sigma of the underlying normal
        mu = np.log(dist.mean) - dist.sigma**2 / 2
        out = np.rint(rng.lognormal(mu, dist.sigma, n))
    return [int(x) for x in np.clip(out, 1, cap)]


def dataset(workload: WorkloadConfig, tokenizer, vocab_size: int, max_position: int):
    """(prompt ids, output lengths, arrival offsets) of a sharegpt or mooncake workload."""
    stamps = None
    if workload.dataset == "sharegpt":
        prompts, outputs = _sharegpt(workload, tokenizer, max_position)
    else:
        prompts, outputs, stamps = _mooncake(workload, vocab_size, max_position)
    return (
        prompts,
        outputs,
        stamps * workload.trace_scale if workload.arrival == "trace" else _arrivals(workload),
    )


def draw(
    workload: WorkloadConfig, max_position: int, tokenizer=None
) -> tuple[np.ndarray, list[int], list[int]]:
    """Arrival offsets, prompt lengths and output lengths (the simulator's workload): the same as
    make_requests gives for the config. A sharegpt workload needs the tokenizer that counts its tokens."""
    if workload.dataset != "random":
        if workload.dataset == "sharegpt" and tokenizer is None:
            from engine.weights import load_model

            tokenizer = load_model("tiny-random").tokenizer  # SmolLM2's
        prompts, outputs, arrivals = dataset(workload, tokenizer, 1 << 20, max_position)
        return np.asarray(arrivals), [len(p) for p in prompts], outputs
    rng = np.random.default_rng(workload.seed)
    n = workload.num_requests
    outputs = sample_lengths(workload.output_len, n, rng, cap=max_position // 2)
    prompts = sample_lengths(workload.prompt_len, n, rng, cap=max_position // 2)
    prompts = [min(p, max_position - o - 1) for p, o in zip(prompts, outputs, strict=True)]
    return _arrivals(workload), prompts, outputs


def _arrivals(workload: WorkloadConfig) -> np.ndarray:
    """Arrival offsets from a stream of their own, so the simulator's draw and a real run's requests
    (which also draw prompt token ids) arrive at the same times."""
    n = workload.num_requests
    if workload.arrival != "poisson":
        return np.zeros(n)
    rng = np.random.default_rng([workload.seed, 1])
    arrivals = np.cumsum(rng.exponential(1.0 / workload.rate, n))
    return arrivals - arrivals[0]  # the first request arrives at once


MOONCAKE_BLOCK = 512  # tokens per hash id in Mooncake's traces


def _sharegpt(workload: WorkloadConfig, tokenizer, max_position: int) -> tuple[list[list[int]], list[int]]:
    """(prompt ids, output lengths) of num_requests conversations, shuffled by the seed; each usable
    conversation (prompt and reply of at least 4 tokens, prompt at most 1024, both within the context)
    is used once before any repeats."""
    with open(workload.dataset_path) as f:
        data = json.load(f)
    usable = []
    for conv in data if isinstance(data, list) else []:
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        prompt, reply = (t.get("value") if isinstance(t, dict) else None for t in turns[:2])
        if not isinstance(prompt, str) or not isinstance(reply, str):
            continue
        ids, out = tokenizer.encode(prompt), len(tokenizer.encode(reply))
        if 4 <= len(ids) <= 1024 and out >= 4 and len(ids) + out < max_position:
            usable.append((ids, out))
    if not usable:
        raise ValueError(
            f"workload.dataset_path={workload.dataset_path!r} holds no usable ShareGPT conversation"
        )
    order = np.random.default_rng(workload.seed).permutation(len(usable))
    picked = [usable[order[i % len(usable)]] for i in range(workload.num_requests)]
    return [p for p, _ in picked], [o for _, o in picked]


def _sharegpt_chats(workload: WorkloadConfig, tokenizer) -> list[list[tuple[list[int], int]]]:
    """A ShareGPT file's conversations as (human message ids, reply token count) turns, in a seeded
    order; a conversation's turns end at its first one that is not a human message and a reply."""
    with open(workload.dataset_path) as f:
        data = json.load(f)
    chats = []
    for conv in data if isinstance(data, list) else []:
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        chat = []
        for i in range(0, len(turns) - 1 if isinstance(turns, list) else 0, 2):
            human, gpt = turns[i], turns[i + 1]
            if not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in (human, gpt)):
                break
            if human.get("from") != "human" or gpt.get("from") != "gpt":
                break
            ids, reply = tokenizer.encode(human["value"]), len(tokenizer.encode(gpt["value"]))
            if not ids or reply < 1:
                break
            chat.append((ids, reply))
        if chat:
            chats.append(chat)
    if not chats:
        raise ValueError(
            f"workload.dataset_path={workload.dataset_path!r} holds no ShareGPT conversation with a "
            "human message and a reply"
        )
    order = np.random.default_rng([workload.seed, 6]).permutation(len(chats))
    return [chats[i] for i in order]


TRACE_FIELDS = "timestamp (ms, in time order), input_length, output_length (tokens) and optional hash_ids"
MAX_TRACE_TOKENS = 1 << 24  # a length past this is not a request's


def trace_row(line: str, number: int, path: str, after_ms: float = 0.0) -> dict:
    """One line of a Mooncake trace, checked: a ValueError naming the file, its line number and the field
    (a bare JSONDecodeError, KeyError or OverflowError said none of them, and a NaN timestamp left its
    request and every later one unsent). after_ms: the previous line's timestamp."""
    where = f"workload.dataset_path={path!r} line {number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        why = f"not JSON ({e.msg}, column {e.colno})"
        raise ValueError(f"{where}: {why}; each line is an object of {TRACE_FIELDS}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a JSON {type(row).__name__}, not an object of {TRACE_FIELDS}")
    for key in ("timestamp", "input_length", "output_length"):
        if key not in row:
            raise ValueError(f"{where}: no {key!r}; each line is an object of {TRACE_FIELDS}")
    stamp = row["timestamp"]
    if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not math.isfinite(stamp) or stamp < 0:
        raise ValueError(f"{where}: timestamp={stamp!r} is not allowed: milliseconds, a finite number >= 0")
    if stamp < after_ms:
        why = f"before the line above's ({after_ms!r}): a trace's lines are in time order"
        raise ValueError(f"{where}: timestamp={stamp!r} is {why}")
    for key in ("input_length", "output_length"):
        value = row[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TRACE_TOKENS:
            raise ValueError(
                f"{where}: {key}={value!r} is not allowed: tokens, an integer in [1, {MAX_TRACE_TOKENS}]"
            )
    ids = row.get("hash_ids")
    if ids is not None and not (
        isinstance(ids, list)
        and all(isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 63 for h in ids)
    ):
        raise ValueError(f"{where}: hash_ids must be a list of integers in [0, 2^63)")
    return row


def mooncake_rows(workload: WorkloadConfig) -> list[dict]:
    """num_requests lines of the trace from its trace_offset-th (timestamp, input_length, output_length,
    hash_ids), each checked (trace_row)."""
    rows, skip, last = [], workload.trace_offset, 0.0
    with open(workload.dataset_path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                if skip:
                    skip -= 1
                    continue
                rows.append(trace_row(line, number, workload.dataset_path, last))
                last = rows[-1]["timestamp"]
            if len(rows) == workload.num_requests:
                break
    if len(rows) < workload.num_requests:
        raise ValueError(
            f"workload.dataset_path={workload.dataset_path!r} holds {len(rows)} requests after "
            f"workload.trace_offset={workload.trace_offset}; workload.num_requests={workload.num_requests}"
        )
    return rows


def mooncake_block(workload: WorkloadConfig) -> int:
    """Tokens a trace's hash id names in this workload: Mooncake's 512, scaled with the lengths."""
    return max(1, round(MOONCAKE_BLOCK * workload.trace_length_scale))


def _mooncake(workload: WorkloadConfig, vocab_size: int, max_position: int):
    """(prompt ids, output lengths, arrival offsets in s) of the trace's first num_requests lines."""
    rows = mooncake_rows(workload)
    prompts, outputs = [], []
    scale, block = workload.trace_length_scale, mooncake_block(workload)
    for row in rows:
        out = max(1, min(round(int(row["output_length"]) * scale), max_position // 2))
        length = max(1, min(round(int(row["input_length"]) * scale), max_position - out - 1))
        ids: list[int] = []
        for h in row.get("hash_ids") or []:  # the same hash id, the same block of tokens
            ids += np.random.default_rng([workload.seed, int(h)]).integers(3, vocab_size, block).tolist()
            if len(ids) >= length:
                break
        if len(ids) < length:
            ids += (
                np.random.default_rng([workload.seed, len(prompts), 2])
                .integers(3, vocab_size, length)
                .tolist()
            )
        prompts.append(ids[:length])
        outputs.append(out)
    stamps = np.asarray([float(r["timestamp"]) for r in rows]) / 1e3
    return prompts, outputs, stamps - stamps[0]


def make_requests(workload: WorkloadConfig, tokenizer, vocab_size: int, max_position: int) -> list[Request]:
    """Seeded: the same config gives the same requests in every deployment (multiturn: the first turns;
    the drivers ask Conversations for the rest)."""
    if workload.dataset == "multiturn":
        return Conversations(workload, vocab_size, max_position, tokenizer).first()
    if workload.dataset != "random":
        prompts, outputs, arrivals = dataset(workload, tokenizer, vocab_size, max_position)
        return [Request(f"req-{i}", float(arrivals[i]), prompts[i], outputs[i]) for i in range(len(prompts))]
    rng = np.random.default_rng(workload.seed)
    n = workload.num_requests
    outputs = sample_lengths(workload.output_len, n, rng, cap=max_position // 2)
    if workload.prompts_file:
        with open(workload.prompts_file) as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
        if not lines:
            raise ValueError(f"workload.prompts_file={workload.prompts_file!r} holds no prompts")
        prompts = [tokenizer.encode(lines[i % len(lines)]) for i in range(n)]
    else:  # random token ids, as vLLM's and SGLang's random datasets (ids 0-2 are usually special)
        lengths = sample_lengths(workload.prompt_len, n, rng, cap=max_position // 2)
        prompts = [rng.integers(3, vocab_size, k).tolist() for k in lengths]
    prompts = [p[: max_position - o - 1] for p, o in zip(prompts, outputs, strict=True)]
    arrivals = _arrivals(workload)
    return [Request(f"req-{i}", float(arrivals[i]), prompts[i], outputs[i]) for i in range(n)]


def synthetic_mooncake(
    num_requests: int,
    reuse: float,
    rate: float = 1.0,
    mean_blocks: float = 8.0,
    mean_output: float = 128.0,
    seed: int = 0,
    step: tuple[float, float] | None = None,
) -> list[dict]:
    """A Mooncake-like trace (the rows `_mooncake` reads: timestamp ms, input_length, output_length,
    hash_ids of 512-token blocks) for runs longer than a sample, with about `reuse` of its blocks shared:
    each request takes the leading round(reuse x n) blocks of a random earlier request (as many as it
    has), then fresh blocks, so shared blocks are always a prefix, as in a conversation or an agent's
    context. Poisson arrivals at `rate`; block counts and output lengths log-normal around the means. The
    Mooncake paper's conversation trace reuses about half its blocks (reuse=0.5). step: (at_s, factor):
    from at_s seconds on, requests arrive factor times as fast (a load step for an elastic deployment)."""
    if not 0 <= reuse < 1:
        raise ValueError(f"reuse must be in [0, 1), got {reuse!r}")
    if step is not None and not (step[0] >= 0 and step[1] > 0):
        raise ValueError(f"step must be (at_s >= 0, factor > 0), got {step!r}")
    rng = np.random.default_rng(seed)
    rows, fresh, t = [], 0, 0.0
    for _ in range(num_requests):
        n = max(1, int(rng.lognormal(np.log(mean_blocks), 0.6)))
        shared: list[int] = []
        if rows and reuse > 0:
            earlier = rows[int(rng.integers(len(rows)))]["hash_ids"]
            shared = earlier[: min(len(earlier), round(reuse * n))]
        ids = shared + list(range(fresh, fresh + n - len(shared)))
        fresh += n - len(shared)
        last = int(rng.integers(1, MOONCAKE_BLOCK + 1))  # the last block is partly filled
        out = max(1, int(rng.lognormal(np.log(mean_output), 0.8)))
        rows.append(
            {
                "timestamp": round(t * 1e3),
                "input_length": (len(ids) - 1) * MOONCAKE_BLOCK + last,
                "output_length": out,
                "hash_ids": ids,
            }
        )
        t += rng.exponential(1.0 / (rate * step[1] if step is not None and t >= step[0] else rate))
    return rows


def block_reuse(rows: list[dict]) -> float:
    """The fraction of a trace's blocks whose hash id an earlier request already had."""
    seen, reused, total = set(), 0, 0
    for row in rows:
        for h in row["hash_ids"]:
            reused += h in seen
            seen.add(h)
            total += 1
    return reused / max(total, 1)


def main(argv: list[str] | None = None) -> None:
    """python -m experiments.workload mooncake OUT.jsonl [--requests N] [--reuse R] [--rate RPS] [--seed S]
    [--step-at S --step-factor F]: write a synthetic Mooncake-like trace (workload.dataset=mooncake
    workload.dataset_path=OUT.jsonl), its arrivals F times as fast from second S on."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m experiments.workload", description=main.__doc__)
    parser.add_argument("kind", choices=["mooncake"])
    parser.add_argument("out")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--reuse", type=float, default=0.5, help="fraction of blocks shared, in [0, 1)")
    parser.add_argument("--rate", type=float, default=1.0, help="mean arrivals per second")
    parser.add_argument("--mean-blocks", type=float, default=8.0, help="mean 512-token blocks per prompt")
    parser.add_argument("--mean-output", type=float, default=128.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-at", type=float, default=None, help="from this second on, arrivals come")
    parser.add_argument("--step-factor", type=float, default=3.0, help="this many times as fast")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.rate <= 0 or args.mean_blocks < 1 or args.mean_output < 1:
        parser.error("--requests, --mean-blocks and --mean-output must be >= 1 and --rate > 0")
    try:
        step = (args.step_at, args.step_factor) if args.step_at is not None else None
        rows = synthetic_mooncake(
            args.requests, args.reuse, args.rate, args.mean_blocks, args.mean_output, args.seed, step
        )
    except ValueError as e:
        parser.error(str(e))
    with open(args.out, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"wrote {len(rows)} requests to {args.out}; {100 * block_reuse(rows):.0f}% of blocks reused")


if __name__ == "__main__":
    main()
