"""What a worker sends of its requests' outputs (serving/worker.py): Progress items for the
streamed ones after each step, and each finished one's Result, with where its prefill ran and what its
KV transfer took.
"""

from __future__ import annotations

from serving.messages import ErrorKind, Result


def progress_items(outputs, streamed: dict, holdback: dict) -> list[tuple]:
    """(request id, new token ids, new text, their logprobs) of each streamed request that gained tokens,
    its text held back by as many characters as a stop string could still claim (a finished request's
    last tokens go in its Result). streamed: request id -> [tokens sent, characters sent], updated."""
    items = []
    for out in outputs:
        sent = streamed[out.request_id]
        if len(out.token_ids) == sent[0]:
            continue
        upto = max(sent[1], len(out.text) - holdback[out.request_id])
        new = (out.token_ids[sent[0] :], out.text[sent[1] : upto], wire_logprobs(out, sent[0]))
        items.append((out.request_id, *new))
        sent[0], sent[1] = len(out.token_ids), upto
    return items


def result_of(out, spec, received: float, dm, prefilled_here: bool, by_load: bool) -> Result:
    """A finished request's Result: out, the engine's output; received, when the worker got it; dm, the
    decode messenger (None: not a decode worker); prefilled_here: this worker computed its prompt;
    by_load: the router sent it here to prefill (deployment.local_prefill_by_load)."""
    rid = out.request_id
    result = Result(
        rid,
        spec.name,
        out.token_ids,
        received,
        out.scheduled_time,
        out.token_times,
        out.finish_reason,
        out.error,
        text=out.text,
        drafted=out.num_drafted_tokens,
        accepted=out.num_accepted_tokens,
        verify_steps=out.num_verify_steps,
        cached_tokens=out.num_cached_tokens or 0,
        logprobs=wire_logprobs(out, 0) if out.logprobs is not None else None,
    )
    if by_load:
        result.prefill_worker = spec.name
    timing = dm.timings.get(rid) if dm is not None else None
    if timing is not None:
        result.prefill, result.transfer_bytes = "remote", timing.nbytes
        result.transfer_s, result.kv_landed = timing.landed - timing.sent, timing.landed
        result.scheduled = timing.first_landed  # its first KV arriving: prefill has begun
        result.prefill_worker = timing.peer
    elif (
        dm is not None
        and not prefilled_here
        and len(out.prompt_token_ids) > spec.deployment.local_prefill_max_tokens
    ):
        result.prefill = "remote"  # its transfer failed (or it was recomputed here)
    if out.error is not None:
        result.prefill_lost = dm is not None and rid in dm.peer_lost
        result.error_kind = ErrorKind.WORKER_LOST if result.prefill_lost else ErrorKind.INTERNAL
    elif out.finish_reason == "abort":
        result.error_kind = ErrorKind.CANCELLED
    return result


def wire_logprobs(out, start: int) -> list:
    """The logprobs of out's tokens from `start` on, as Result and Progress carry them (a request that
    resumed after tokens made elsewhere has none for those: the runtime keeps them)."""
    if out.logprobs is None:
        return []
    offset = len(out.token_ids) - len(out.logprobs)
    return [
        [(t, lp.logprob, lp.rank) for t, lp in entry.items()]
        for entry in out.logprobs[max(0, start - offset) :]
    ]
