"""A decode worker's requests before its engine runs them (serving/decode_front.py): which it
prefills itself and which wait for a prefill worker's KV."""

from engine import LLM, SamplingParams
from engine.disagg import decode_messenger
from serving.decode_front import DecodeFront
from serving.messages import Submit
from transfer.backends import make_backend
from transfer.handoff import Cause

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def _front(local_max_tokens=0):
    llm = LLM("tiny-random", role="decode", page_size=4, num_pages=64)
    dm = decode_messenger(llm, make_backend("local", f"front-{local_max_tokens}"))
    return llm, DecodeFront(llm, local_max_tokens, 0.0, name="decode-0", dm=dm)


def test_a_request_the_router_sends_here_by_load_is_prefilled_here_and_marked():
    llm, front = _front()
    front.take(Submit("mine", list(range(5, 45)), PARAMS, prefill_worker="decode-0"), PARAMS, set())
    front.take(Submit("theirs", list(range(5, 45)), PARAMS, prefill_worker="prefill-0"), PARAMS, set())
    assert "mine" in llm.core.seqs  # queued in the engine: computed here
    assert front.prefilled_here == {"mine": Cause.BY_LOAD}  # its result says prefill "local", by load
    assert [w.request_id for w in front.backlog] == ["theirs"]  # waits for prefill-0's KV
    assert [w.peer for w in front.backlog] == ["prefill-0"]
    done = {}
    while llm.has_unfinished():
        done.update((o.request_id, o) for o in llm.step() if o.finished)
    assert len(done["mine"].token_ids) == 4
    assert front.drop("mine") is False and front.prefilled_here == {}  # a cancel forgets the mark


def test_a_short_prompt_is_prefilled_here_without_a_mark():
    llm, front = _front(local_max_tokens=16)
    front.take(Submit("short", list(range(5, 15)), PARAMS), PARAMS, set())
    assert "short" in llm.core.seqs and not front.prefilled_here and not front.backlog
