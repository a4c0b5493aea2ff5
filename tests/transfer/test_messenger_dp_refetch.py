"""A decode worker of DP groups under memory pressure (its own module: one DP engine per process at a
time, and tests/transfer/test_messenger_dp.py's stays up for its module)."""

import random

from engine import DPLLM, LLM, SamplingParams
from tests.transfer.messengers import _close, _local_pair, _refetching_worker, _run

MODEL = "tiny-random-deepseek"


def test_refetches_inside_another_group_go_back_to_it_and_all_finish():
    """All requests on DP group 1 with too few pages there and no admission horizon: group 1's engine
    preempts, the front hands its preempted sequences back (take_refetches), they are fetched again into
    group 1 and every request finishes with the tokens it has alone, every page back."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prefill = LLM(MODEL, role="prefill", page_size=4, num_pages=512)
    decode = DPLLM(
        MODEL, role="decode", page_size=4, num_pages=80, dp=2, reserved_tokens=0, preemption="refetch"
    )
    pm, dm = _local_pair(prefill, decode, "refetch")
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(3, 49000) for _ in range(60)] for i in range(8)}
    backlog, refetched = [(rid, p, 1) for rid, p in prompts.items()], []
    worker = _refetching_worker(decode, dm, backlog, params, refetched)
    try:
        _run(prefill, decode, pm, dm, list(prompts), tick=worker)
        reference = LLM(MODEL, page_size=4, num_pages=512, enable_prefix_caching=False)
        for rid, prompt in prompts.items():
            assert decode.output(rid).token_ids == reference.generate([prompt], params)[0].token_ids, rid
        assert refetched and all(group == 1 for _, _, group in refetched)
        assert decode.preemption_stats["preemptions"] > 0  # group 1's, summed by the front
        assert decode.pages == (160, 160) and prefill.allocator.num_free == 512
    finally:
        _close(pm, dm)
        decode.close()
