"""A decode worker of DP groups fed e4m3 pages (engine/dp.py, its own file: one DP engine a process at a
time, and test_messenger_dp.py keeps one for its whole module)."""

from engine import DPLLM, LLM
from tests.transfer.messengers import GREEDY, _close, _local_pair, _run

MODEL, PAGES = "tiny-random-deepseek", 64


def test_e4m3_pages_and_their_scales_land_in_each_group_and_decode_as_one_engine():
    """Both sides in e4m3: each request's latent pages and scales land in its group's region (its agent's)
    and decode as one e4m3 engine's would. Prompts of 4k + 1 tokens: the prefill side's pages are whole,
    filled as the one engine's prefill fills them (e4m3 rounds a page again as rows join it)."""
    fp8 = dict(kv_dtype="fp8_e4m3", page_size=4, num_pages=PAGES)
    prompts = [list(range(100 + 7 * i, 100 + 7 * i + 4 * (2 + i) + 1)) for i in range(6)]
    expected = [o.token_ids for o in LLM(MODEL, **fp8).generate(prompts, GREEDY)]
    prefill = LLM(MODEL, role="prefill", **fp8)
    decode = DPLLM(MODEL, role="decode", dp=2, **fp8)
    pm, dm = _local_pair(prefill, decode, "dp-fp8")
    try:
        ids = [f"f{i}" for i in range(len(prompts))]
        for i, (rid, prompt) in enumerate(zip(ids, prompts, strict=True)):
            assert dm.submit(rid, prompt, GREEDY, group=i % 2)
        _run(prefill, decode, pm, dm, ids)
        assert [decode.output(rid).token_ids for rid in ids] == expected
        decode.step()  # the other group reports its pages after a step
        assert not dm.dropped and not dm.pending and decode.pages == (2 * PAGES, 2 * PAGES)
    finally:
        _close(pm, dm)
        decode.close()
