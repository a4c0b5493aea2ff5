import numpy as np

from experiments.config import LengthDist, WorkloadConfig
from experiments.workload import draw, make_requests


def test_the_simulator_draws_the_requests_a_real_run_sends():
    """Same config, same arrivals and lengths, whether drawn for the simulator or made with token ids."""
    w = WorkloadConfig(
        rate=3.0,
        num_requests=50,
        prompt_len=LengthDist("uniform", low=4, high=300),
        output_len=LengthDist("lognormal", mean=40.0, sigma=0.8),
        seed=7,
    )
    arrivals, prompts, outputs = draw(w, max_position=512)
    reqs = make_requests(w, tokenizer=None, vocab_size=1000, max_position=512)
    assert np.allclose(arrivals, [r.arrival_s for r in reqs])
    assert prompts == [len(r.prompt_ids) for r in reqs] and outputs == [r.max_tokens for r in reqs]
    assert arrivals[0] == 0 and np.all(np.diff(arrivals) >= 0)
    assert len(set(prompts)) > 10  # the lengths do vary


def test_fixed_concurrency_requests_all_arrive_at_once():
    reqs = make_requests(WorkloadConfig(arrival="concurrency", num_requests=5), None, 100, 512)
    assert [r.arrival_s for r in reqs] == [0.0] * 5


DATA = __import__("pathlib").Path(__file__).resolve().parents[1] / "data"


def test_sharegpt_prompts_are_first_turns_and_outputs_the_reply_length():
    import json

    from engine.weights import load_model

    tok = load_model("tiny-random").tokenizer
    w = WorkloadConfig(num_requests=12, dataset="sharegpt", dataset_path=str(DATA / "sharegpt_sample.json"))
    reqs = make_requests(w, tok, tok.vocab_size, 2048)
    turns = {
        c["conversations"][0]["value"]: c["conversations"][1]["value"]
        for c in json.loads((DATA / "sharegpt_sample.json").read_text())
        if len(c["conversations"]) > 1
    }
    usable = {q: a for q, a in turns.items() if len(tok.encode(q)) >= 4 and len(tok.encode(a)) >= 4}
    assert len(usable) == 8  # "hi" is too short; the one-turn conversation has no reply
    seen = [tok.decode(r.prompt_ids) for r in reqs]
    assert set(seen[:8]) == set(usable) and seen[8:] == seen[:4]  # each once, then repeats in order
    assert all(r.max_tokens == len(tok.encode(usable[tok.decode(r.prompt_ids)])) for r in reqs)
    arrivals, prompts, outputs = draw(w, 2048, tok)  # the simulator's view of the same requests
    assert prompts == [len(r.prompt_ids) for r in reqs] and outputs == [r.max_tokens for r in reqs]


def test_mooncake_trace_lengths_timestamps_and_shared_prefixes():
    path = str(DATA / "mooncake_sample.jsonl")
    w = WorkloadConfig(num_requests=12, dataset="mooncake", dataset_path=path, arrival="trace")
    reqs = make_requests(w, None, 1000, 4096)
    rows = [__import__("json").loads(line) for line in open(path)]
    assert [len(r.prompt_ids) for r in reqs] == [row["input_length"] for row in rows]
    assert [r.max_tokens for r in reqs] == [row["output_length"] for row in rows]
    want = [(row["timestamp"] - rows[0]["timestamp"]) / 1e3 for row in rows]
    assert np.allclose([r.arrival_s for r in reqs], want)
    # requests 0 and 3 share hash ids 1000, 1001: the same first 1024 tokens; then they differ
    assert reqs[0].prompt_ids[:1024] == reqs[3].prompt_ids[:1024] != reqs[1].prompt_ids[:1024]
    assert reqs[0].prompt_ids[1024:1100] != reqs[3].prompt_ids[1024:1100]
    arrivals, prompts, outputs = draw(w, 4096)
    assert np.allclose(arrivals, [r.arrival_s for r in reqs]) and outputs == [r.max_tokens for r in reqs]
    faster = make_requests(__import__("dataclasses").replace(w, trace_scale=0.5), None, 1000, 4096)
    assert np.allclose([r.arrival_s for r in faster], np.asarray(want) / 2)


def test_dataset_config_errors_name_the_key(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="workload.dataset_path=None is not allowed"):
        WorkloadConfig(dataset="sharegpt")
    with pytest.raises(ValueError, match="workload.dataset='lmsys' is not allowed"):
        WorkloadConfig(dataset="lmsys")
    with pytest.raises(ValueError, match="trace needs workload.dataset=mooncake"):
        WorkloadConfig(arrival="trace")
    with pytest.raises(ValueError, match="holds 12 requests"):
        make_requests(
            WorkloadConfig(
                num_requests=50, dataset="mooncake", dataset_path=str(DATA / "mooncake_sample.jsonl")
            ),
            None,
            1000,
            4096,
        )


def test_multiturn_turns_carry_the_history_and_arrive_after_the_think_time():
    from experiments.workload import Conversations

    w = WorkloadConfig(
        dataset="multiturn", arrival="poisson", rate=2.0, conversations=3, turns=3, system_prompt_len=20,
        turn_len=7, think_time_s=1.5, output_len=LengthDist(value=5),
    )  # fmt: skip
    conv = Conversations(w, vocab_size=1000, max_position=512)
    first = make_requests(w, None, 1000, 512)
    assert [(r.conversation, r.turn) for r in first] == [(0, 0), (1, 0), (2, 0)]
    assert all(r.prompt_ids[:20] == conv.system and len(r.prompt_ids) == 27 for r in first)
    assert first[0].arrival_s == 0 < first[1].arrival_s < first[2].arrival_s  # Poisson over conversations
    assert first[0].prompt_ids[20:] != first[1].prompt_ids[20:]  # each its own message
    second = conv.next(first[0], [9, 9, 9], ended_s=4.0)
    assert second.arrival_s == 5.5 and (second.conversation, second.turn) == (0, 1)
    assert second.prompt_ids[:30] == first[0].prompt_ids + [9, 9, 9] and len(second.prompt_ids) == 37
    third = conv.next(second, [8], ended_s=6.0)
    assert third.prompt_ids[:38] == second.prompt_ids + [8] and conv.next(third, [1], 9.0) is None
    again = Conversations(w, 1000, 512).next(first[0], [9, 9, 9], 4.0)  # every deployment: the same turns
    assert again == second
    short = Conversations(w, 1000, max_position=40)  # the next turn would not fit: the conversation ends
    assert short.next(first[0], [9] * 3, 1.0) is None


def test_multiturn_config_errors_name_the_key():
    import pytest

    for key, value in (("turns", 0), ("conversations", -1), ("turn_len", 1.5), ("think_time_s", -1)):
        with pytest.raises(ValueError, match=f"workload.{key}="):
            WorkloadConfig(dataset="multiturn", **{key: value})
