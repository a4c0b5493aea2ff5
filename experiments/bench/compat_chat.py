"""A LangChain ChatOpenAI or a LiteLLM completion against an OpenAI-compatible server, unchanged: `n`
chats at `concurrency` at once, half streamed and half not, each timed as the client sees it. Runs in the
clients' own venv (`make compat`: .compat/langchain), so it imports nothing of this project.

python experiments/bench/compat_chat.py {langchain,litellm} URL MODEL N CONCURRENCY OUT.json
OUT.json: {client, version, ok, failed, errors (the first few), requests: [{stream, ttft_s, itl_s, e2e_s,
chunks}]}; ttft_s and itl_s only for streamed ones (the first chunk with text; the mean gap after it).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from importlib.metadata import version

PROMPT = "Write a short story about a robot who learns to paint. Number {i}."
MAX_TOKENS = 32


async def _langchain(url: str, model: str, i: int, stream: bool) -> dict:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=model, base_url=url, api_key="none", max_tokens=MAX_TOKENS, temperature=0,
                      max_retries=0, stream_usage=True)  # fmt: skip
    messages = [("system", "You are a helpful assistant."), ("human", PROMPT.format(i=i))]
    start, times, text = time.perf_counter(), [], ""
    if stream:
        async for chunk in chat.astream(messages):
            if chunk.content:
                times.append(time.perf_counter())
                text += chunk.content
    else:
        text = (await chat.ainvoke(messages)).content
    return {"start": start, "times": times, "end": time.perf_counter(), "text": text}


async def _litellm(url: str, model: str, i: int, stream: bool) -> dict:
    import litellm

    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": PROMPT.format(i=i)}]  # fmt: skip
    kw = dict(model=f"openai/{model}", api_base=url, api_key="none", messages=messages, max_tokens=MAX_TOKENS,
              temperature=0, num_retries=0)  # fmt: skip
    start, times, text = time.perf_counter(), [], ""
    if stream:
        async for chunk in await litellm.acompletion(stream=True, **kw):
            piece = chunk.choices[0].delta.content if chunk.choices else None
            if piece:
                times.append(time.perf_counter())
                text += piece
    else:
        text = (await litellm.acompletion(**kw)).choices[0].message.content
    return {"start": start, "times": times, "end": time.perf_counter(), "text": text}


async def run(client: str, url: str, model: str, n: int, concurrency: int) -> dict:
    call = _langchain if client == "langchain" else _litellm
    gate, out, errors = asyncio.Semaphore(concurrency), [], []

    async def one(i: int) -> None:
        async with gate:
            stream = i % 2 == 0
            try:
                got = await call(url, model, i, stream)
            except Exception as e:  # a failed request: counted, the first few kept
                errors.append(f"{type(e).__name__}: {e}"[:300])
                return
            times = got["times"]
            row = {"stream": stream, "e2e_s": got["end"] - got["start"], "chunks": len(times),
                   "ok": bool(got["text"])}  # fmt: skip
            if times:
                row["ttft_s"] = times[0] - got["start"]
                row["itl_s"] = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
            out.append(row)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    package = "langchain-openai" if client == "langchain" else "litellm"
    ok = sum(1 for r in out if r["ok"])
    return {
        "client": client,
        "version": version(package),
        "ok": ok,
        "failed": n - ok,
        "errors": errors[:5],
        "duration_s": time.perf_counter() - start,
        "requests": out,
    }


def main() -> None:
    client, url, model, n, concurrency, out = sys.argv[1:7]
    if client not in ("langchain", "litellm"):
        raise SystemExit(f"client must be langchain or litellm, got {client!r}")
    result = asyncio.run(run(client, url, model, int(n), int(concurrency)))
    with open(out, "w") as f:
        json.dump(result, f)
    print(f"{client}: {result['ok']} ok, {result['failed']} failed")


if __name__ == "__main__":
    main()
