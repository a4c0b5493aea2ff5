import random

import pytest
import torch

from engine import LLM, SamplingParams
from pdkernels import ops
from tests.kept import keep_outputs

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(rng.choice([1, 2, 5, 17, 33, 50, 70]))] for _ in range(n)]


@pytest.fixture(scope="module")
def alone():
    """Greedy tokens of each prompt run by itself, the reference for every batching below."""
    llm = LLM("tiny-random", num_pages=64, page_size=4)
    return [llm.generate([p], GREEDY)[0].token_ids for p in _prompts(16)]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"page_size": 4, "num_pages": 512},  # everything at once
        {
            "page_size": 16,
            "num_pages": 512,
            "max_num_batched_tokens": 24,
        },  # chunked prefill mixed with decode
        {"page_size": 16, "num_pages": 512, "max_num_batched_tokens": 24, "kv_layout": "NHD"},  # [P, H] pages
        # pressure: admission with room to finish (no fair share) queues requests instead of preempting
        {
            "page_size": 4,
            "num_pages": 40,
            "max_num_batched_tokens": 64,
            "max_num_seqs": 6,
            "fair_share": False,
        },
        # pressure with each request's fair share: more start at once, and some are preempted
        {"page_size": 4, "num_pages": 40, "max_num_batched_tokens": 64, "max_num_seqs": 6},
        # no horizon (only the next token is owed): preemption and recompute
        {
            "page_size": 4,
            "num_pages": 40,
            "max_num_batched_tokens": 64,
            "max_num_seqs": 6,
            "reserved_tokens": 0,
        },
    ],
)
def test_concurrent_requests_match_one_at_a_time(alone, kwargs):
    llm = LLM("tiny-random", **kwargs)
    outs = llm.generate(_prompts(16), GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" and len(o.token_times) == 12 for o in outs)
    assert llm.allocator.num_free == kwargs["num_pages"]
    stats = llm.preemption_stats
    if kwargs.get("reserved_tokens") == 0:  # the case exercises recompute after preemption
        assert stats["preemptions"] > 0 and stats["recomputed_tokens"] > 0
    elif kwargs["num_pages"] == 40 and kwargs.get("fair_share", True):
        pass  # preempted or not, the tokens are the same (above)
    else:
        assert stats == {"preemptions": 0, "recomputed_tokens": 0, "refetched_tokens": 0}


def test_a_latent_cache_is_the_same_in_either_layout():
    """One latent head a page: NHD and HND are the same bytes, and the same tokens."""
    prompts = _prompts(4)
    hnd, nhd = (LLM("tiny-random-deepseek", page_size=8, num_pages=64, kv_layout=k) for k in ("HND", "NHD"))
    assert nhd.kv_cache.shape == hnd.kv_cache.shape
    assert [o.token_ids for o in nhd.generate(prompts, GREEDY)] == [
        o.token_ids for o in hnd.generate(prompts, GREEDY)
    ]


def test_prefill_then_decode_on_copied_pages(alone):
    """Prefill computes prompt[:-1]; its pages, copied into a decode worker, finish the request."""
    prefill = LLM("tiny-random", role="prefill", page_size=4, num_pages=256, max_num_batched_tokens=32)
    decode = LLM("tiny-random", role="decode", page_size=4, num_pages=300)
    keep_outputs(prefill), keep_outputs(decode)
    prompts = _prompts(16)
    ids = {
        i: prefill.add_request(p[:-1], GREEDY, request_id=f"r{i}")
        for i, p in enumerate(prompts)
        if len(p) > 1
    }
    while prefill.has_unfinished():
        outs = prefill.step()
        assert all(not o.token_ids for o in outs)  # prefill never samples
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        seq = decode.handoff.reserve(prompt, GREEDY, request_id=rid)
        dst = decode.allocator.pages(rid)
        assert decode.allocator.is_pinned(rid)
        if i in ids:  # a one-token prompt has no KV to move: decode runs its only token
            assert prefill.output(rid).finish_reason == "prefilled"
            src = prefill.allocator.pages(rid)
            assert len(src) == len(dst)
            decode.kv_cache[:, dst] = prefill.kv_cache[:, src]
            prefill.handoff.release(rid)
        decode.handoff.admit_prefilled(seq.request_id)
    assert prefill.allocator.num_free == 256
    while decode.has_unfinished():
        decode.step()
    assert [decode.output(f"r{i}").token_ids for i in range(len(prompts))] == alone
    assert decode.allocator.num_free == 300


def test_prefill_role_bumps_each_layer_once_per_pass():
    llm = LLM("tiny-random", role="prefill", page_size=4, num_pages=64)
    llm.add_request(list(range(5, 40)), GREEDY)
    passes = 0
    while llm.has_unfinished():
        llm.step()
        passes += 1
    assert llm.core.counter.tolist() == [[passes] * 4, [0] * 4]


@pytest.mark.parametrize("model", ["tiny-random", "tiny-random-deepseek"])
def test_a_warm_up_pass_gives_its_pages_back_bumps_no_counter_and_changes_no_token(model, alone):
    """On one GPU the engine runs a dummy prefill at start (the kernels compile there, not in the first
    request's TTFT); here it is called by hand: every page back, the prefill role's counter untouched,
    and the same greedy tokens after it."""
    llm = LLM(model, role="prefill", page_size=4, num_pages=64, max_num_batched_tokens=600)
    free, passes, run = llm.allocator.num_free, [], llm.runner.warm_up
    llm.runner.warm_up = lambda lengths, pages, counter: (
        passes.append(lengths) or run(lengths, pages, counter)
    )
    llm.warm_up()  # 599 tokens: more than the pages hold, so the long pass takes what is free
    # the shapes Triton specializes apart: one sequence and several, token counts of 16k and not, decodes
    assert passes == [[256], [32, 16], [17, 5, 1], [1, 1], [1]]
    assert llm.allocator.num_free == free
    assert llm.core.counter.tolist() == [[0] * llm.config.arch.num_layers] * 2
    if model == "tiny-random":
        colocated = LLM(model, num_pages=64, page_size=4)
        colocated.warm_up()
        assert [o.token_ids for o in colocated.generate(_prompts(16), GREEDY)] == alone


def test_random_stops_and_aborts_leave_no_page_behind():
    llm = LLM("tiny-random", page_size=4, num_pages=200, max_num_seqs=8, max_num_batched_tokens=48)
    keep_outputs(llm)
    rng = random.Random(3)
    ids = []
    for i, prompt in enumerate(_prompts(100, seed=1)):
        params = SamplingParams(
            max_tokens=rng.randint(1, 20),
            temperature=rng.choice([0.0, 0.8]),
            seed=i,
            stop=rng.choice([(), ("e",), ("the", "a")]),
        )
        ids.append(llm.add_request(prompt, params))
    steps = 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
        if steps % 3 == 0:
            llm.abort(rng.choice(ids))
    outs = [llm.output(i) for i in ids]
    assert {o.finish_reason for o in outs} >= {"abort", "length"}
    assert all(o.finished for o in outs)
    assert llm.allocator.num_free == 200


def test_text_prompts_stop_strings_and_streaming_times():
    llm = LLM("tiny-random", page_size=4, num_pages=64)
    out = llm.generate("Hello there", SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert out.text and len(out.token_ids) == 20 and out.ttft > 0 and out.tpot > 0
    stop = out.text[len(out.text) // 2 :][:3]
    cut = llm.generate("Hello there", SamplingParams(max_tokens=20, ignore_eos=True, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and out.text.startswith(cut.text)


def test_triton_kernels_give_the_same_tokens(alone):
    """The same model on the Triton kernels (interpreter) as on the torch references."""
    ops.set_backend("triton")  # the interpreter is on in tests
    try:
        llm = LLM("tiny-random", page_size=4, num_pages=64, dtype="float32")
        picked = [1, 3]  # 5 and 2 tokens: the interpreter takes seconds per long prompt
        prompts = [_prompts(16)[i] for i in picked]
        outs = llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
        assert ops.resolve("decode_attention", llm.kv_cache.device) == "triton"
    finally:
        ops.set_backend("torch")
    assert [o.token_ids for o in outs] == [alone[i][:3] for i in picked]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: LLM("gpt-17"), "model must be one of"),
        (lambda: LLM("/nonexistent/model.gguf"), "does not exist"),
        (lambda: LLM("tiny-random", tp=3), "tp=3 must divide"),
        (lambda: LLM("tiny-random", role="router"), "role must be one of"),
        (lambda: LLM("tiny-random", dtype="int8"), "dtype must be one of"),
        (lambda: LLM("tiny-random", kv_layout="HDN"), "kv_layout must be one of"),
    ],
)
def test_bad_engine_config(make, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        make()


def test_bad_requests():
    llm = LLM("tiny-random", page_size=4, num_pages=8)
    with pytest.raises(ValueError, match="context holds 2048"):
        llm.add_request(list(range(3000)))
    with pytest.raises(ValueError, match="too few for one request"):
        llm.add_request(list(range(30)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        llm.generate("hi", SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.add_request([])
    assert llm.allocator.num_free == 8 and not llm.has_unfinished()
    torch.testing.assert_close(llm.kv_cache, torch.zeros_like(llm.kv_cache))


VOCAB = 49152  # tiny-random's vocabulary


@pytest.mark.parametrize(
    "prompt, params, error, field",
    [
        ([1, VOCAB], {}, ValueError, r"prompt\[1\] is 49152"),
        ([2**63], {}, ValueError, r"prompt\[0\]"),
        ([-1], {}, ValueError, r"prompt\[0\]"),
        ([1.0, 2], {}, TypeError, r"prompt\[0\] is 1.0"),
        ([True], {}, TypeError, r"prompt\[0\]"),
        (["a", "b"], {}, TypeError, r"prompt\[0\]"),
        (b"hello", {}, TypeError, "prompt must be a string or a list of token ids"),
        ([1], {"temperature": float("nan")}, ValueError, "temperature must be finite"),
        ([1], {"temperature": -1}, ValueError, "temperature must be 0 \\(greedy\\) or in"),
        ([1], {"top_p": float("inf")}, ValueError, "top_p must be finite"),
        ([1], {"top_p": 0}, ValueError, "top_p must be in"),
        ([1], {"top_k": -1}, ValueError, "top_k must be an integer >= 0"),
        ([1], {"top_k": 2.5}, TypeError, "top_k must be"),
        ([1], {"max_tokens": 1.5}, TypeError, "max_tokens must be"),
        ([1], {"max_tokens": True}, TypeError, "max_tokens must be"),
        ([1], {"seed": 2**63}, ValueError, "seed must be"),
        ([1], {"seed": "7"}, TypeError, "seed must be"),
        ([1], {"stop": [1, 2]}, TypeError, "stop must be"),
        ([1], {"stop": ""}, TypeError, "stop must be"),
        ([1], {"ignore_eos": "yes"}, TypeError, "ignore_eos must be"),
    ],
)
def test_bad_input_names_the_field_and_the_engine_keeps_serving(prompt, params, error, field):
    llm = LLM("tiny-random", page_size=4, num_pages=16)
    with pytest.raises(error, match=field):
        llm.generate([prompt], SamplingParams(**params))
    assert llm.allocator.num_free == 16 and not llm.has_unfinished()
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True, stop=None))[0]
    assert len(out.token_ids) == 3 and llm.allocator.num_free == 16


def test_a_step_that_raises_fails_its_sequences_and_frees_their_pages():
    llm = LLM("tiny-random", page_size=4, num_pages=16)
    run, calls = llm.runner.run, []

    def broken(batch, counter=None):
        calls.append(1)
        if len(calls) == 2:  # the second step: both requests are running by then
            raise RuntimeError("injected")
        return run(batch, counter)

    llm.runner.run = broken
    outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["error", "error"]
    assert all("injected" in o.error for o in outs) and llm.allocator.num_free == 16
    again = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert again.finish_reason == "length" and llm.allocator.num_free == 16


@pytest.mark.parametrize("key", ["temperature", "repetition_penalty"])
def test_a_request_whose_sampling_fails_ends_alone(key):
    """Parameters that slipped past the checks (1e-300, set after them) make the sampler raise ("probability
    tensor contains inf/nan"): only that request ends with the error; 4 greedy streams beside it finish."""
    llm = LLM("tiny-random", page_size=4, num_pages=64)
    bad = SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=1)
    object.__setattr__(bad, key, 1e-300)  # as a request that got past validation would be
    good = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = _prompts(5, seed=3)
    outs = llm.generate(prompts, [good, good, bad, good, good])
    assert outs[2].finish_reason == "error" and "sampling failed" in outs[2].error
    others = [o for i, o in enumerate(outs) if i != 2]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in others)
    alone = llm.generate([prompts[0]], good)[0]
    assert alone.token_ids == outs[0].token_ids  # the failure changed nothing for its neighbours
    assert llm.allocator.num_free == 64


def test_a_top_p_that_rounds_to_zero_keeps_the_likeliest_token():
    llm = LLM("tiny-random", page_size=4, num_pages=64)
    tiny = SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=1)
    object.__setattr__(tiny, "top_p", 1e-300)  # 0 in fp32: once every token was dropped (NaN)
    prompt = _prompts(1, seed=4)
    out = llm.generate(prompt, tiny)[0]
    assert out.finish_reason == "length"
    assert out.token_ids == llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize(  # make test: the decode role's (the colocated one schedules the same way)
    "role", [pytest.param("colocated", marks=pytest.mark.slow), "decode"]
)
def test_a_new_request_does_not_wait_for_long_outputs(role):
    """Three 900-token streams on a worker owed their growth to 512 tokens each, so a new
    request waited for them (1,791 steps on 256 pages, 6.6 s on the server; here 300-token streams on
    96 pages). With each request owed only its share of the cache, the new one starts at once (as many
    steps to its first token as alone); the long ones pay with a preemption when the pages run out, and
    all finish with every page back."""

    def start(llm: LLM, prompt: list[int], params: SamplingParams, request_id: str) -> None:
        if role == "colocated":
            llm.add_request(prompt, params, request_id)
            return
        llm.handoff.reserve(
            prompt, params, request_id
        )  # raises OutOfPages while the pages are owed to others
        llm.handoff.admit_prefilled(
            request_id
        )  # as if its KV had landed (here none did: the tokens do not matter)

    def steps_to_first_token(streams: int) -> tuple[int, LLM]:
        llm = LLM("tiny-random", role=role, page_size=4, num_pages=96)
        for i in range(streams):
            start(
                llm, list(range(10 + i, 20 + i)), SamplingParams(max_tokens=300, ignore_eos=True), f"long{i}"
            )
        for _ in range(10):
            llm.step()
        start(llm, [5, 6, 7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True), "victim")
        for steps in range(1, 5000):
            if any(o.request_id == "victim" and o.token_ids for o in llm.step()):
                return steps, llm
        raise AssertionError("the victim never got its first token")

    quiet, _ = steps_to_first_token(0)
    loaded, llm = steps_to_first_token(3)
    assert loaded <= 2 * quiet, (loaded, quiet)
    while llm.has_unfinished():
        llm.step()
    assert llm.allocator.num_free == 96


def test_a_finished_request_id_can_be_used_again_once_forgotten():
    llm = LLM("tiny-random", page_size=4, num_pages=16)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.add_request([5, 6], params, request_id="r")
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request([5, 6], params, request_id="r")
    while llm.has_unfinished():
        llm.step()
    llm.core.forget("r")
    assert "r" not in llm.core.seqs
    llm.add_request([5, 6], params, request_id="r")


def test_tp_that_fits_neither_sharding_nor_replication():
    from engine.config import EngineConfig, ModelConfig

    model = ModelConfig(
        name="m",
        vocab_size=10,
        hidden_size=96,
        intermediate_size=96,
        num_layers=1,
        num_heads=12,
        num_kv_heads=4,
        head_dim=8,
    )
    with pytest.raises(ValueError, match="must divide the 4 kv heads or be a multiple of them"):
        # 12 q heads split 2 per rank, but 4 kv heads neither split nor replicate over 6 ranks
        EngineConfig(arch=model, tp=6)
    EngineConfig(arch=model, tp=2)  # 2 kv heads per rank


def test_reserve_out_of_pages_takes_nothing():
    from engine.kv.cache import OutOfPages

    llm = LLM("tiny-random", role="decode", page_size=4, num_pages=8)
    llm.handoff.reserve(
        list(range(5, 25)), SamplingParams(max_tokens=4), request_id="a"
    )  # 19 tokens: 5 pages
    with pytest.raises(OutOfPages):
        llm.handoff.reserve(list(range(5, 25)), SamplingParams(max_tokens=4), request_id="b")
    assert "b" not in llm.core.seqs and llm.allocator.num_free == 3
    llm.handoff.release("a")
    assert llm.allocator.num_free == 8


@pytest.mark.parametrize("reserved_tokens, admits_c", [(512, False), (None, False), (0, True), (4, True)])
def test_reserve_keeps_room_for_admitted_requests_to_finish(reserved_tokens, admits_c):
    """a (19 + 20 tokens to come: 10 pages) and b (7 + 8: 4 pages) are admitted; c would find its 2
    prompt pages free, but then a and b could not finish: it waits, unless the horizon is short (or each
    request is owed only its fair share, the default: test_a_new_request_does_not_wait_for_long_outputs)."""
    from engine.kv.cache import OutOfPages

    llm = LLM(
        "tiny-random",
        role="decode",
        page_size=4,
        num_pages=16,
        reserved_tokens=reserved_tokens,
        fair_share=False,
    )
    llm.handoff.reserve(list(range(5, 25)), SamplingParams(max_tokens=20), request_id="a")  # 5 pages now
    llm.handoff.reserve(list(range(5, 13)), SamplingParams(max_tokens=8), request_id="b")  # 2 pages now
    assert llm.allocator.num_free == 9
    c = (list(range(5, 13)), SamplingParams(max_tokens=8))
    if admits_c:
        llm.handoff.reserve(*c, request_id="c")
        return
    with pytest.raises(OutOfPages, match="owed to admitted requests"):
        llm.handoff.reserve(*c, request_id="c")
    assert "c" not in llm.core.seqs and llm.allocator.num_free == 9  # took nothing
    llm.core.stop("b", "its transfer failed")  # as the decode messenger ends a request: fail, then free
    llm.handoff.release("b")
    llm.handoff.reserve(*c, request_id="c")  # b's pages and what it was owed are back


def test_a_request_id_sent_again_before_its_pages_are_released_is_refused_not_a_crash():
    """The runtime resends a request whose prefill worker went silent; the decode worker may still hold
    the first attempt's pages (a write could still land): the new one is refused, a ValueError the
    decode front turns into that request's own error."""
    llm = LLM("tiny-random", role="decode", page_size=4, num_pages=16)
    prompt, params = list(range(5, 25)), SamplingParams(max_tokens=4)
    llm.handoff.reserve(prompt, params, request_id="a")
    llm.core.stop("a", "its prefill worker went silent")
    llm.step()  # hands the stopped request back: its id leaves llm.core.seqs, its pages stay pinned
    assert "a" not in llm.core.seqs and llm.allocator.pages("a")
    with pytest.raises(ValueError, match="until the pages of an earlier request of that id are released"):
        llm.handoff.reserve(prompt, params, request_id="a")
    llm.handoff.release("a")
    llm.handoff.reserve(prompt, params, request_id="a")  # released: the id is free again


def test_vllm_shaped_outputs_and_chat():
    llm = LLM("smollm2-135m", num_pages=64)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    messages = [{"role": "user", "content": "Say hi."}]
    (out,) = llm.chat(messages, params)
    (ref,) = llm.generate([llm.apply_chat_template(messages)], params)
    assert out.outputs[0].token_ids == ref.token_ids and out.outputs[0].text == ref.text
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].index == 0
    assert out.text == llm.tokenizer.decode(out.token_ids)  # the streamed text is the decoded text
    assert [o.token_ids for o in llm.chat([messages, messages], params)] == [ref.token_ids] * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="no CUDA device"):
        LLM("tiny-random", device="cuda")


def test_set_role_keeps_the_weights_and_changes_only_what_the_role_does():
    """An elastic worker's engine: prefill -> colocated generates what a fresh engine does (drafts
    proposed again with speculation), -> prefill counts layers again; never with a request in flight."""
    prompts = [[5, 9, 13, 2, 7], list(range(3, 30))]
    params = SamplingParams(max_tokens=6)
    fresh = [o.token_ids for o in LLM("tiny-random", page_size=4, num_pages=64).generate(prompts, params)]
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    llm = LLM("tiny-random", role="prefill", page_size=4, num_pages=64, speculative_config=spec)
    assert llm.scheduler.propose is None and llm.core.counter is not None
    llm.set_role("colocated")
    assert llm.scheduler.propose is not None and llm.scheduler.role == "colocated"
    assert [o.token_ids for o in llm.generate(prompts, params)] == fresh
    llm.add_request([1, 2, 3], params, "busy")
    with pytest.raises(ValueError, match=r"set_role\('prefill'\) needs an idle engine; 1 requests are here"):
        llm.set_role("prefill")
    llm.abort("busy")
    llm.step()  # hands the aborted request back
    llm.set_role("prefill")
    assert llm.scheduler.propose is None and llm.config.scheduler.role == "prefill"
    with pytest.raises(ValueError, match="role must be one of prefill, decode, colocated, got 'router'"):
        llm.set_role("router")
