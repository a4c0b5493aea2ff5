"""The KV messenger on a GPU: NIXL between two engines' VRAM caches in one process (make gpu-check)."""

import random
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.disagg import decode_messenger, prefill_messenger
from tests.kept import keep_outputs
from tests.pdkernels.test_gpu import _report
from tests.transfer.messengers import _run
from transfer.backends import make_backend
from transfer.config import TransferConfig
from transfer.protocol import local_channel, wait_hello

pytestmark = pytest.mark.gpu

MODEL = dict(model="random-llama-1b", device="cuda", dtype="bfloat16", num_pages=512)  # 16 layers


def test_layer_zero_is_posted_over_nixl_while_the_gpu_pass_runs():
    """A 2,000-token prompt (random-llama-1b holds 2,048) prefilled in one pass on the GPU: the sender
    thread posts layer 0's pages (a NIXL write, VRAM to VRAM) before the pass that computed them has
    finished on the device, and the decode side's tokens are the colocated engine's."""
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    prompt = [random.Random(0).randrange(3, 49000) for _ in range(2000)]
    prefill = LLM(role="prefill", max_num_batched_tokens=2048, **MODEL)
    decode = LLM(role="decode", **MODEL)
    config = TransferConfig(backend="nixl")
    keep_outputs(prefill), keep_outputs(decode)
    decode_end, prefill_end = local_channel()
    pm = prefill_messenger(prefill, make_backend("nixl", "p-gpu"), config)
    pm.add_peer(prefill_end)
    dm = decode_messenger(decode, make_backend("nixl", "d-gpu"), config)
    dm.add_peer("prefill-0", decode_end, wait_hello(decode_end, timeout_s=10))
    passes, run = [], prefill.runner.run

    def timed_run(batch, counter=None):  # the pass's end is when the device has finished it
        start = time.perf_counter()
        out = run(batch, counter)
        torch.cuda.synchronize()
        passes.append((start, time.perf_counter()))
        return out

    prefill.runner.run = timed_run
    try:
        dm.submit("r", prompt, greedy)
        _run(prefill, decode, pm, dm, ["r"], timeout_s=120)
        got = decode.output("r")
        assert got.finish_reason == "length"
        ((start, end),) = passes
        posted = {layer: t for _, layer, t in sorted(pm.post_log, key=lambda e: -e[2])}  # each layer's first
        _report(
            "layer_posts_1p1d",
            {"pass_ms": round(1e3 * (end - start), 2)}
            | {f"layer_{i}_ms": round(1e3 * (posted[i] - start), 2) for i in (0, 7, 15) if i in posted},
        )
        assert set(posted) == set(range(16))
        assert start < posted[0] < end, (
            f"layer 0 posted at +{1e3 * (posted[0] - start):.1f} ms, pass ended +{1e3 * (end - start):.1f}"
        )
    finally:
        pm.close()
        pm.backend.close()
        dm.backend.close()
    colocated = LLM(max_num_batched_tokens=2048, **MODEL).generate([prompt], greedy)[0]
    assert got.token_ids == colocated.token_ids
