"""LLM.step() hands each finished request back once and forgets it; tests that look at a request after the
fact keep what step() returned."""

from engine import LLM
from engine.sequence import RequestOutput


def keep_outputs(llm: LLM) -> dict[str, RequestOutput]:
    """Record every output llm.step() returns (the latest per request); llm.output(id) then answers for
    finished requests from the record. Returns the record."""
    kept: dict[str, RequestOutput] = {}
    step, output = llm.step, llm.output

    def recording():
        outs = step()
        kept.update((o.request_id, o) for o in outs)
        return outs

    llm.step = recording
    llm.output = lambda request_id: output(request_id) if request_id in llm.core.seqs else kept[request_id]
    llm.kept = kept
    return kept


def finished(llm: LLM, request_id: str) -> bool:
    """Has step() handed this request back finished? (llm went through keep_outputs)"""
    out = llm.kept.get(request_id)
    return out is not None and out.finished
