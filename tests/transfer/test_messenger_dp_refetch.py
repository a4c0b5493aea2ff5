"""A decode worker of DP groups under memory pressure (its own module: one DP engine per process at a
time, and tests/transfer/test_messenger_dp.py's stays up for its module)."""

import random

from engine import LLM, SamplingParams
from engine.disagg import decode_messenger, prefill_messenger
from engine.kv_cache import OutOfPages
from tests.kept import keep_outputs
from tests.transfer.messengers import _run
from transfer.backends import make_backend
from transfer.config import TransferConfig
from transfer.protocol import local_channel, wait_hello

MODEL = "tiny-random-deepseek"


def test_refetches_inside_another_group_go_back_to_it_and_all_finish():
    """All requests on DP group 1 with too few pages there and no admission horizon: group 1's engine
    preempts, the front hands its preempted sequences back (take_refetches), they are fetched again into
    group 1 and every request finishes with the tokens it has alone, every page back."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    config = TransferConfig(backend="local")
    prefill = LLM(MODEL, role="prefill", page_size=4, num_pages=512)
    decode = LLM(
        MODEL, role="decode", page_size=4, num_pages=80, dp=2, reserved_tokens=0, preemption="refetch"
    )
    keep_outputs(prefill), keep_outputs(decode)
    decode_end, prefill_end = local_channel()
    pm = prefill_messenger(prefill, make_backend("local", "p-refetch"), config)
    pm.add_peer(prefill_end)
    groups = [make_backend("local", "d-refetch-1")]
    dm = decode_messenger(decode, make_backend("local", "d-refetch-0"), config, group_backends=groups)
    dm.add_peer("prefill-0", decode_end, wait_hello(decode_end, timeout_s=1))
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(3, 49000) for _ in range(60)] for i in range(8)}
    backlog = [(rid, p, 1) for rid, p in prompts.items()]
    refetched = []

    def worker() -> bool:  # as the decode worker: preempted requests first, then new ones, while pages last
        again = [(s.request_id, s.all_ids, decode.dp_rank_of(s.request_id)) for s in decode.take_refetches()]
        refetched.extend(again)
        backlog[:0] = again
        while backlog:
            rid, ids, group = backlog[0]
            try:
                dm.submit(rid, ids, params, group=group)
            except OutOfPages:
                break
            backlog.pop(0)
        return not backlog

    try:
        _run(prefill, decode, pm, dm, list(prompts), tick=worker)
        reference = LLM(MODEL, page_size=4, num_pages=512, enable_prefix_caching=False)
        for rid, prompt in prompts.items():
            assert decode.output(rid).token_ids == reference.generate([prompt], params)[0].token_ids, rid
        assert refetched and all(group == 1 for _, _, group in refetched)
        assert decode.preemption_stats["preemptions"] > 0  # group 1's, summed by the front
        assert decode.pages == (160, 160) and prefill.allocator.num_free == 512
    finally:
        pm.close()
        decode.close()
