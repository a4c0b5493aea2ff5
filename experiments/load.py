"""The load client for any OpenAI-compatible server: a deployment of `kind: endpoint` in the main job.

    python -m experiments.run 'deployments=[{name: vllm, kind: endpoint, url: "http://127.0.0.1:8001/v1",
        model: HuggingFaceTB/SmolLM2-135M-Instruct}]'

Each request of the workload goes out on the workload's schedule (Poisson arrivals or a fixed number in
flight) as a streamed completion of its prompt token ids, with `max_tokens` and the workload's sampling
(workload.sampling: greedy and vLLM's `ignore_eos` by default, so every server produces the asked-for
length), through the official
`openai` client. The first text chunk's arrival is the first token, each later chunk an inter-token
gap; the usage chunk gives the output token count (and, where the server reports it, the prompt tokens
its cache held); a 503 (a server shedding load: our deployment.admission=slo) or a 429 (over a client's
share: our server.max_sequences_per_client, 32 in flight from one address) is a `rejected` request, not
an error. The results are the same Result records the in-process driver collects, so an external
server's row sits beside ours in one run folder, measured by the same client code path.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

from engine.sequence import SamplingParams
from experiments.config import SET_BY_WORKLOAD, EndpointConfig, RunConfig
from experiments.record import DeploymentRun, Request
from experiments.workload import Conversations
from serving.messages import ErrorKind, Result


def run_endpoint(
    config: RunConfig,
    d: EndpointConfig,
    requests: list[Request],
    progress: bool = True,
    turns: Conversations | None = None,
    tokenizer=None,
):
    """turns: a multiturn workload's conversations (requests are their first turns); each reply's text,
    tokenized with tokenizer, goes into the next turn's prompt."""
    run = DeploymentRun(d, list(requests), turns=turns)
    try:
        asyncio.run(_drive(run, config, d, progress, tokenizer))
    except KeyboardInterrupt:
        run.interrupted = True
    kind = ErrorKind.CANCELLED if run.interrupted else ErrorKind.DEADLINE  # never sent, or timed out
    run.end_unfinished(kind, "not finished", d.name)
    return run


async def _drive(run: DeploymentRun, config: RunConfig, d: EndpointConfig, progress: bool, tokenizer) -> None:
    import openai
    from tqdm import tqdm

    client = openai.AsyncOpenAI(base_url=d.url, api_key=d.api_key or "none", max_retries=0, timeout=None)
    model = d.model or config.model.name
    w = config.workload
    bar = tqdm(total=len(run.requests), desc=d.name, disable=not progress, unit="req")
    slots = asyncio.Semaphore(w.concurrency) if w.arrival == "concurrency" else contextlib.nullcontext()
    tasks: set[asyncio.Task] = set()

    async def one(req: Request) -> None:
        # on the schedule (0 under concurrency, but a multiturn turn's think time), then a slot
        await asyncio.sleep(max(0.0, run.start + req.arrival_s - time.perf_counter()))
        async with slots:
            sent = run.sent[req.request_id] = time.perf_counter()
            times, text, n, reason, cached = [], [], None, None, 0
            try:
                stream = await client.completions.create(
                    model=model,
                    prompt=list(req.prompt_ids),
                    stream=True,
                    stream_options={"include_usage": True},
                    **_sampling(w.sampling, req.max_tokens),
                )
                async for chunk in stream:
                    now = time.perf_counter()
                    if chunk.usage is not None:
                        n = chunk.usage.completion_tokens
                        details = chunk.usage.prompt_tokens_details  # a server that reports its cache hits
                        cached = (details.cached_tokens or 0) if details is not None else 0
                    for choice in chunk.choices:  # each chunk brings tokens, its text perhaps empty (a
                        times.append(now)  # character's first bytes): timed as vLLM's benchmark does
                        text.append(choice.text or "")
                        reason = choice.finish_reason or reason
                result = Result(
                    req.request_id, d.name, [], sent, None, times, reason, None, text="".join(text)
                )
                result.output_tokens = n if n is not None else len(times)
                result.cached_tokens = cached
            except openai.APIStatusError as e:
                kind = _kind(e)
                result = Result.failed(req.request_id, kind, f"{type(e).__name__}: {e}", d.name, sent)
            except Exception as e:  # the server went away: this request fails alone
                result = Result.failed(
                    req.request_id, ErrorKind.WORKER_LOST, f"{type(e).__name__}: {e}", d.name, sent
                )
            run.results[req.request_id] = result
            bar.update()
        if result.error is None and run.turns is not None:  # the reply as text: our tokens of it
            nxt = run.follow(req, tokenizer.encode(result.text), time.perf_counter())
            if nxt is not None:
                bar.total += 1
                start(nxt)

    def start(req: Request) -> None:
        task = asyncio.create_task(one(req))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def until_done() -> None:
        while tasks:
            await asyncio.gather(*list(tasks))

    run.start = time.perf_counter()
    for r in list(run.requests):
        start(r)
    try:
        await asyncio.wait_for(until_done(), config.run_timeout_s)
    except TimeoutError:
        pass
    finally:
        run.end = time.perf_counter()
        bar.close()
        await client.close()


_KINDS = {400: ErrorKind.BAD_REQUEST, 408: ErrorKind.CANCELLED, 504: ErrorKind.DEADLINE}  # else internal


def _kind(error) -> ErrorKind:
    """Why a server refused or failed a request: our server says it in the error's `code` (an ErrorKind:
    a lost worker is not a refusal); from any other, a 503 or 429 is load shed (rejected), not a failure."""
    if error.code in set(ErrorKind):
        return ErrorKind(error.code)
    if error.status_code in (429, 503):
        return ErrorKind.REJECTED
    return _KINDS.get(error.status_code, ErrorKind.INTERNAL)


def _sampling(sampling: SamplingParams, max_tokens: int) -> dict:
    """The workload's sampling (workload.sampling, an engine.SamplingParams) as a completion's arguments:
    OpenAI's own, and vLLM's extras (top_k, ignore_eos, min_p, structured_outputs, ...) in the body, as
    vLLM and ours take them; fields at their defaults are left out but for temperature, top_p, ignore_eos."""
    args = {"max_tokens": max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p}
    extra = {"ignore_eos": sampling.ignore_eos}
    for f in dataclasses.fields(SamplingParams):
        value = getattr(sampling, f.name)
        if f.name in (*args, "ignore_eos", *SET_BY_WORKLOAD) or value == f.default or value is None:
            continue
        if f.name == "seed":
            args["seed"] = value
        elif f.name == "structured_outputs":
            spec = dataclasses.asdict(value).items()
            extra[f.name] = {
                k: list(v) if isinstance(v, tuple) else v for k, v in spec if v not in (None, False)
            }
        elif f.name == "logit_bias":  # OpenAI's: token ids as strings
            extra[f.name] = {str(k): v for k, v in value.items()}
        else:
            extra[f.name] = list(value) if isinstance(value, tuple) else value
    return {**args, "extra_body": extra}
