"""engine.model's decode step through pdkernels.cpu's DenseDecoder (every layer in one C++ call) against
the same step through the Python layers: the same bits, the same KV written, each layer counted once; and
where it does not serve, the Python layers run."""

from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams
from pdkernels import cpu
from pdkernels.out_proj import make_layer_counter


def _llm(model="tiny-random", dtype="bfloat16"):
    return LLM(model, device="cpu", dtype=dtype, page_size=4, num_pages=64, enable_prefix_caching=False)


def _chunks(lengths, page_size, decode: bool):
    """Sequences of these lengths, their pages in turn: the whole prompts, or each one's next token."""
    chunks, first = [], 0
    for i, n in enumerate(lengths):
        total = n + decode
        pages = list(range(first, first + -(-total // page_size)))
        first = pages[-1] + 1
        tokens = [(7 * i + t) % 200 + 1 for t in range(total)]
        start = n if decode else 0
        chunks.append(SimpleNamespace(token_ids=tokens[start:total], start=start, end=total,
                                      num_tokens=total - start, pages=pages))  # fmt: skip
    return SimpleNamespace(chunks=chunks)


@pytest.fixture(scope="module")
def prefilled():
    """tiny-random in bf16 with three prompts in its cache (5, 8 and 13 tokens: a page's end, and not)."""
    llm = _llm()
    if llm.model.decoder is None:
        pytest.skip("no DenseDecoder here (the C++ extension or oneDNN's packing is missing)")
    lengths = [5, 8, 13]
    ids, meta = llm.runner.meta(_chunks(lengths, 4, decode=False))
    llm.model.forward(ids, meta, llm.kv_cache)
    return llm, lengths


def test_the_c_plus_plus_decode_step_gives_the_python_layers_bits(prefilled):
    llm, lengths = prefilled
    model, layers = llm.model, llm.model.config.num_layers
    ids, meta = llm.runner.meta(_chunks(lengths, 4, decode=True))
    assert meta.all_decode
    results, decoder = [], model.decoder
    try:
        for model.decoder in (decoder, None):
            kv = llm.kv_cache.clone()
            meta.counter = make_layer_counter(layers, torch.device("cpu"))
            results.append((model.forward(ids, meta, kv), kv, meta.counter))
    finally:
        model.decoder = decoder
    (fused, fused_kv, fused_count), (plain, plain_kv, plain_count) = results
    assert fused.shape == (len(lengths), llm.model.config.hidden_size)
    assert torch.equal(fused, plain) and torch.equal(fused_kv, plain_kv)
    assert fused_count[0].tolist() == [1] * layers == plain_count[0].tolist()
    assert not torch.equal(fused_kv, llm.kv_cache)  # the step wrote its tokens' K and V


def test_generation_is_the_same_with_and_without_it():
    llm = _llm()
    if llm.model.decoder is None:
        pytest.skip("no DenseDecoder here")
    prompts = [[3, 1, 4, 1, 5], list(range(10, 40))]

    def tokens():
        return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))]

    fused = tokens()
    llm.model.decoder = None
    assert tokens() == fused and all(len(t) == 12 for t in fused)


@pytest.mark.parametrize("model, dtype", [("tiny-random", "float32"), ("tiny-random-moe", "bfloat16"),
                                          ("tiny-random-deepseek", "bfloat16")])  # fmt: skip
def test_models_it_does_not_fit_keep_their_python_layers(model, dtype):
    assert _llm(model, dtype).model.decoder is None


def test_a_cache_of_the_wrong_shape_is_refused_by_name(prefilled):
    llm, lengths = prefilled
    ids, meta = llm.runner.meta(_chunks(lengths, 4, decode=True))
    x = llm.model.embed[ids]
    cos, sin = (t[meta.positions.long()] for t in (llm.model.cos, llm.model.sin))
    tables = (meta.batch_indices, meta.positions, meta.kv_indices, meta.kv_indptr, meta.kv_last_page_len)
    with pytest.raises(RuntimeError, match="kv_cache"):
        llm.model.decoder.run(x, x.clone(), cos, sin, *tables, llm.kv_cache[:1], None)
    assert cpu.module() is not None
