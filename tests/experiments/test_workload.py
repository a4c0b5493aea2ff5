import json

import numpy as np
import pytest

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


def test_a_mooncake_trace_scaled_down_keeps_its_blocks_equal_where_the_ids_are():
    """Lengths x 1/16 (a block of 32 tokens an id), a later slice from trace_offset."""
    import dataclasses
    import json

    path = str(DATA / "mooncake_sample.jsonl")
    rows = [json.loads(line) for line in open(path)]
    w = WorkloadConfig(
        num_requests=12, dataset="mooncake", dataset_path=path, arrival="trace", trace_length_scale=1 / 16
    )
    reqs = make_requests(w, None, 1000, 4096)
    assert [len(r.prompt_ids) for r in reqs] == [max(1, round(row["input_length"] / 16)) for row in rows]
    assert [r.max_tokens for r in reqs] == [max(1, round(row["output_length"] / 16)) for row in rows]
    # requests 0 and 3 share their first two ids: 64 equal tokens, then they differ
    assert reqs[0].prompt_ids[:64] == reqs[3].prompt_ids[:64] != reqs[1].prompt_ids[:64]
    assert reqs[0].prompt_ids[64:80] != reqs[3].prompt_ids[64:80]
    later = make_requests(dataclasses.replace(w, trace_offset=3, num_requests=9), None, 1000, 4096)
    assert [r.prompt_ids for r in later] == [r.prompt_ids for r in reqs[3:]]
    assert later[0].arrival_s == 0.0  # the slice's own clock


def test_dataset_config_errors_name_the_key(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="workload.dataset_path=None is not allowed"):
        WorkloadConfig(dataset="sharegpt")
    with pytest.raises(ValueError, match="workload.dataset='lmsys' is not allowed"):
        WorkloadConfig(dataset="lmsys")
    with pytest.raises(ValueError, match="trace needs workload.dataset=mooncake"):
        WorkloadConfig(arrival="trace")
    for key, bad in (("trace_length_scale", 0), ("trace_length_scale", 2.0), ("trace_offset", -1)):
        with pytest.raises(ValueError, match=f"workload.{key}={bad!r} is not allowed"):
            WorkloadConfig(**{key: bad})
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


def test_a_synthetic_mooncake_trace_reuses_the_blocks_asked_for_and_runs_as_a_dataset(tmp_path):
    import json

    import pytest

    from experiments.workload import block_reuse, main, synthetic_mooncake

    for reuse in (0.0, 0.3, 0.5):
        rows = synthetic_mooncake(400, reuse, rate=2.0, seed=1)
        assert abs(block_reuse(rows) - reuse) < 0.08, reuse
        stamps = [r["timestamp"] for r in rows]
        assert stamps[0] == 0 and stamps == sorted(stamps)
        for row in rows:  # the prompt spans its blocks, the last one partly
            assert (len(row["hash_ids"]) - 1) * 512 < row["input_length"] <= len(row["hash_ids"]) * 512
    path = tmp_path / "trace.jsonl"
    main(["mooncake", str(path), "--requests", "30", "--reuse", "0.5", "--seed", "2"])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == synthetic_mooncake(30, 0.5, seed=2)
    w = WorkloadConfig(num_requests=30, dataset="mooncake", dataset_path=str(path), arrival="trace")
    reqs = make_requests(w, None, 1000, 1 << 16)
    shared = next(
        (i, j)
        for j, b in enumerate(lines)
        for i, a in enumerate(lines[:j])
        if a["hash_ids"][0] == b["hash_ids"][0]
    )
    assert (
        reqs[shared[0]].prompt_ids[:512] == reqs[shared[1]].prompt_ids[:512]
    )  # a shared block: the same tokens
    with pytest.raises(SystemExit):
        main(["mooncake", str(path), "--reuse", "1.0"])


def test_multiturn_from_sharegpt_uses_its_human_turns_and_reply_lengths():
    from engine.weights import load_model
    from experiments.workload import Conversations

    tok = load_model("tiny-random").tokenizer
    path = str(DATA / "sharegpt_multiturn_sample.json")
    w = WorkloadConfig(dataset="multiturn", dataset_path=path, conversations=4, turns=5, system_prompt_len=0)
    conv = Conversations(w, tok.vocab_size, 2048, tok)
    first = conv.first()
    texts = {tok.decode(r.prompt_ids) for r in first[:3]}  # three usable conversations, then a repeat
    assert texts == {
        "What is a KV cache in a transformer?",
        "Name a prime number.",
        "Translate 'cache' into French.",
    }
    assert tok.decode(first[3].prompt_ids) == tok.decode(first[0].prompt_ids)
    turns = {}
    for req in first[:3]:
        chain, r = [req], req
        while (r := conv.next(r, [7, 7], 0.0)) is not None:
            chain.append(r)
        turns[tok.decode(req.prompt_ids)] = chain
    kv = turns["What is a KV cache in a transformer?"]
    assert len(kv) == 3 and kv[1].max_tokens == len(
        tok.encode("One key and one value per token, per layer and head.")
    )
    assert kv[1].prompt_ids == kv[0].prompt_ids + [7, 7] + tok.encode("Why does it grow with the context?")
    assert len(turns["Name a prime number."]) == 1  # its second turn is not a human message and a reply
    assert len(turns["Translate 'cache' into French."]) == 2
    import pytest

    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        Conversations(w, tok.vocab_size, 2048)
    with pytest.raises(ValueError, match="workload.dataset_path='nope.json' is not allowed"):
        WorkloadConfig(dataset="multiturn", dataset_path="nope.json")


def test_a_synthetic_trace_with_a_rate_step_arrives_that_much_faster_after_it(tmp_path):
    import json

    import pytest

    from experiments.workload import main, synthetic_mooncake

    rows = synthetic_mooncake(2000, 0.5, rate=2.0, seed=3, step=(300.0, 3.0))
    t = [r["timestamp"] / 1e3 for r in rows]
    before = sum(1 for x in t if x < 300) / 300
    after = (len(t) - sum(1 for x in t if x < 300)) / (t[-1] - 300)
    assert before == pytest.approx(2.0, rel=0.15) and after == pytest.approx(6.0, rel=0.15)
    path = tmp_path / "step.jsonl"
    main(["mooncake", str(path), "--requests", "50", "--seed", "3", "--step-at", "5", "--step-factor", "3"])
    assert [json.loads(line) for line in path.read_text().splitlines()] == synthetic_mooncake(
        50, 0.5, seed=3, step=(5.0, 3.0)
    )
    with pytest.raises(ValueError, match="step must be"):
        synthetic_mooncake(5, 0.5, step=(1.0, 0.0))


def test_a_trace_replays_on_its_own_clock_unless_told_otherwise():
    """A new user's `workload.dataset=mooncake` once ran at the default Poisson 1 req/s and ignored the
    trace's timestamps without a word."""
    path = str(DATA / "mooncake_sample.jsonl")
    assert WorkloadConfig(dataset="mooncake", dataset_path=path).arrival == "trace"
    assert WorkloadConfig().arrival == "poisson"  # random prompts have no clock
    told = WorkloadConfig(dataset="mooncake", dataset_path=path, arrival="poisson", rate=3.0)
    assert told.arrival == "poisson"
    assert (
        WorkloadConfig(dataset="mooncake", dataset_path=path, arrival="concurrency").arrival == "concurrency"
    )


GOOD = {"timestamp": 5, "input_length": 10, "output_length": 3, "hash_ids": [1, 2]}


@pytest.mark.parametrize(
    "line, field",
    [
        ("{not json", "not JSON"),
        ('{"timestamp": 1, "input_length": 10', "not JSON"),
        ("[1, 2, 3]", "a JSON list, not an object"),
        ('"text"', "a JSON str, not an object"),
        ('{"timestamp": 9, "input_length": 10}', "no 'output_length'"),
        ('{"input_length": 10, "output_length": 3}', "no 'timestamp'"),
        ('{"timestamp": NaN, "input_length": 10, "output_length": 3}', "timestamp=nan is not allowed"),
        ('{"timestamp": Infinity, "input_length": 10, "output_length": 3}', "timestamp=inf is not allowed"),
        ('{"timestamp": 1e400, "input_length": 10, "output_length": 3}', "timestamp=inf is not allowed"),
        ('{"timestamp": -1, "input_length": 10, "output_length": 3}', "timestamp=-1 is not allowed"),
        ('{"timestamp": "5", "input_length": 10, "output_length": 3}', "timestamp='5' is not allowed"),
        ('{"timestamp": true, "input_length": 10, "output_length": 3}', "timestamp=True is not allowed"),
        ('{"timestamp": 1, "input_length": 10, "output_length": 3}', "is before the line above's (5)"),
        ('{"timestamp": 9, "input_length": 10, "output_length": 1e400}', "output_length=inf is not allowed"),
        ('{"timestamp": 9, "input_length": 1e30, "output_length": 3}', "input_length=1e+30 is not allowed"),
        ('{"timestamp": 9, "input_length": 99999999999, "output_length": 3}', "input_length=99999999999"),
        ('{"timestamp": 9, "input_length": 10, "output_length": 0}', "output_length=0 is not allowed"),
        ('{"timestamp": 9, "input_length": 10, "output_length": 2.5}', "output_length=2.5 is not allowed"),
        ('{"timestamp": 9, "input_length": 10, "output_length": 3, "hash_ids": [-1]}', "hash_ids must be"),
        ('{"timestamp": 9, "input_length": 10, "output_length": 3, "hash_ids": "1,2"}', "hash_ids must be"),
        ('{"timestamp": 9, "input_length": 10, "output_length": 3, "hash_ids": [1e99]}', "hash_ids must be"),
    ],
)
def test_a_bad_trace_line_is_refused_naming_its_line_number_and_field(tmp_path, line, field):
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + line + "\n" + json.dumps({**GOOD, "timestamp": 99}) + "\n")
    w = WorkloadConfig(num_requests=3, dataset="mooncake", dataset_path=str(path))
    with pytest.raises(ValueError) as err:
        make_requests(w, None, 1000, 4096)
    assert f"workload.dataset_path={str(path)!r} line 3: " in str(err.value) and field in str(err.value)


def test_a_trace_line_of_a_length_no_request_has_is_refused(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({**GOOD, "hash_ids": list(range(200_000)), "input_length": 1 << 30}) + "\n")
    with pytest.raises(ValueError, match="line 1: input_length=1073741824 is not allowed"):
        make_requests(
            WorkloadConfig(num_requests=1, dataset="mooncake", dataset_path=str(path)), None, 1000, 4096
        )
