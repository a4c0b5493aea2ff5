"""engine.model's steps through pdkernels.cpu's DenseDecoder (every layer in one C++ call) against the same
steps through the Python layers: decode steps, and where the AMX attention serves, steps with prompt
tokens (whole prompts, chunks after a prefix, several requests): the same bits, the same KV written, each
layer counted once; and where it does not serve, the Python layers run."""

import re
from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model import Model
from engine.runner import ModelRunner
from engine.weights import tiny_random
from pdkernels import cpu
from pdkernels.out_proj import make_layer_counter


def _llm(model="tiny-random", dtype="bfloat16"):
    return LLM(model, device="cpu", dtype=dtype, page_size=4, num_pages=64, enable_prefix_caching=False)


def _dim32():
    """A 2-layer random model whose head dim (32) the AMX attention takes: 6 query heads over 2 (SmolLM2's
    group of 3), its runner over a 64-page cache of 4 tokens a page."""
    loaded = tiny_random("tiny-dim32", geometry=(192, 256, 2, 6, 2, 32))
    model = Model(loaded.config, loaded.weights, torch.device("cpu"), torch.bfloat16)
    cache = torch.zeros(2, 64, 2, 2, 4, 32, dtype=torch.bfloat16)
    return SimpleNamespace(model=model, kv_cache=cache, runner=ModelRunner(model, cache, 4))


def _int8_block_model():
    """_dim32's model in fp32 with every projection exactly int8 blocks, as a GGUF file's Q8_0 weights
    dequantize (SmolLM2's): each held as a cpu.Q8Weight too, so its decode steps take the C++ step on the
    int8-block kernel (AVX2 + FMA)."""
    from tests.pdkernels.test_cpu import _int8_blocks

    loaded = tiny_random("tiny-dim32", geometry=(192, 256, 2, 6, 2, 32))
    weights = {
        name: _int8_blocks(*w.shape, "q8_0", seed=i) if name.endswith("proj.weight") else w
        for i, (name, w) in enumerate(loaded.weights.items())
    }
    model = Model(loaded.config, weights, torch.device("cpu"), torch.float32)
    cache = torch.zeros(2, 160, 2, 2, 4, 32)  # room for 34 sequences
    return SimpleNamespace(model=model, kv_cache=cache, runner=ModelRunner(model, cache, 4))


def _chunks(lengths, page_size, decode: bool, new=None):
    """Sequences of these lengths, their pages in turn: the whole prompts, each one's next token, or (new)
    that many more tokens each."""
    chunks, first = [], 0
    for i, n in enumerate(lengths):
        total = n + (new[i] if new else decode)
        pages = list(range(first, first + -(-total // page_size)))
        first = pages[-1] + 1
        tokens = [(7 * i + t) % 200 + 1 for t in range(total)]
        start = n if decode or new else 0
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


def _same_step(llm, meta, ids):
    """The step through the decoder and through the Python layers, each on a copy of the cache."""
    model, layers = llm.model, llm.model.config.num_layers
    results, decoder = [], model.decoder
    try:
        for model.decoder in (decoder, None):
            kv = llm.kv_cache.clone()
            meta.counter = make_layer_counter(layers, torch.device("cpu"))
            results.append((model.forward(ids, meta, kv), kv, meta.counter))
    finally:
        model.decoder = decoder
    return results


def test_the_c_plus_plus_decode_step_gives_the_python_layers_bits(prefilled):
    llm, lengths = prefilled
    layers = llm.model.config.num_layers
    ids, meta = llm.runner.meta(_chunks(lengths, 4, decode=True))
    assert meta.all_decode
    (fused, fused_kv, fused_count), (plain, plain_kv, plain_count) = _same_step(llm, meta, ids)
    assert fused.shape == (len(lengths), llm.model.config.hidden_size)
    assert torch.equal(fused, plain) and torch.equal(fused_kv, plain_kv)
    assert fused_count[0].tolist() == [1] * layers == plain_count[0].tolist()
    assert not torch.equal(fused_kv, llm.kv_cache)  # the step wrote its tokens' K and V


def test_the_c_plus_plus_decode_step_on_int8_block_weights_gives_the_python_layers_bits():
    """fp32 on an AVX2 CPU (no bf16 there): the projections on the int8 copy of each weight, in C++ as in
    Python; and past Q8_MAX_M rows the fp32 GEMM in both."""
    llm = _int8_block_model()
    if llm.model.decoder is None:
        pytest.skip("no int8-block kernel here (the C++ extension built without AVX2 + FMA)")
    assert all(type(layer["qkv"]) is cpu.Q8Weight for layer in llm.model.layers)
    assert not llm.model.decoder_extends  # steps with prompt tokens: the Python layers
    for lengths in ([5, 8, 13], [3 + i % 7 for i in range(cpu.Q8_MAX_M + 2)]):
        llm.kv_cache.zero_()
        llm.model.forward(*llm.runner.meta(_chunks(lengths, 4, decode=False)), llm.kv_cache)
        ids, meta = llm.runner.meta(_chunks(lengths, 4, decode=True))
        assert meta.all_decode
        (fused, fused_kv, fused_count), (plain, plain_kv, plain_count) = _same_step(llm, meta, ids)
        assert torch.isfinite(fused).all() and torch.equal(fused, plain) and torch.equal(fused_kv, plain_kv)
        assert fused_count[0].tolist() == plain_count[0].tolist() == [1] * llm.model.config.num_layers


def test_the_c_plus_plus_decode_step_on_bf16_panels_gives_the_python_layers_bits():
    """bf16 on AVX-512 BF16 without AMX: the projections on each weight's panels (cpu.PanelWeight) up to
    PANEL_MAX_M rows, in C++ as in Python; and past them oneDNN's GEMM in both."""
    if not cpu.panels_serve():
        pytest.skip("no bf16 panels here (they serve AVX-512 BF16 CPUs without AMX)")
    loaded = tiny_random("tiny-dim32", geometry=(192, 256, 2, 6, 2, 32))
    model = Model(loaded.config, loaded.weights, torch.device("cpu"), torch.bfloat16)
    cache = torch.zeros(2, 160, 2, 2, 4, 32, dtype=torch.bfloat16)  # room for 34 sequences
    llm = SimpleNamespace(model=model, kv_cache=cache, runner=ModelRunner(model, cache, 4))
    assert model.decoder is not None and type(model.lm_head) is cpu.PanelWeight
    assert all(
        type(layer[k]) is cpu.PanelWeight for layer in model.layers for k in ("qkv", "o", "gate_up", "down")
    )
    for lengths in ([5, 8, 13], [3 + i % 7 for i in range(cpu.PANEL_MAX_M + 2)]):
        llm.kv_cache.zero_()
        model.forward(*llm.runner.meta(_chunks(lengths, 4, decode=False)), llm.kv_cache)
        ids, meta = llm.runner.meta(_chunks(lengths, 4, decode=True))
        assert meta.all_decode
        (fused, fused_kv, fused_count), (plain, plain_kv, plain_count) = _same_step(llm, meta, ids)
        assert (
            torch.isfinite(fused.float()).all()
            and torch.equal(fused, plain)
            and torch.equal(fused_kv, plain_kv)
        )
        assert fused_count[0].tolist() == plain_count[0].tolist() == [1] * model.config.num_layers
        with torch.profiler.profile() as prof:  # the step's projections went through the panels, or not
            model.forward(ids, meta, llm.kv_cache.clone())
        calls = sum(e.key == "pdk::bf16_linear" for e in prof.key_averages() for _ in range(e.count))
        assert calls == (4 * model.config.num_layers if len(lengths) <= cpu.PANEL_MAX_M else 0)


@pytest.mark.parametrize("new", [[1, 9, 2], [4, 0, 30], [40, 40, 40]])
def test_the_c_plus_plus_prefill_step_gives_the_python_layers_bits(new):
    """Chunks after cached prompts (one request with none: its rows skipped), whole pages and not."""
    llm, lengths = _dim32(), [5, 8, 13]
    if not llm.model.decoder_extends:
        pytest.skip("steps with prompt tokens take the Python layers here (no AMX)")
    llm.model.forward(*llm.runner.meta(_chunks(lengths, 4, decode=False)), llm.kv_cache)  # the prompts
    ids, meta = llm.runner.meta(_chunks(lengths, 4, decode=False, new=new))
    assert not meta.all_decode
    (fused, fused_kv, fused_count), (plain, plain_kv, plain_count) = _same_step(llm, meta, ids)
    assert fused.shape == (sum(new), llm.model.config.hidden_size)
    assert torch.equal(fused, plain) and torch.equal(fused_kv, plain_kv)
    assert fused_count[0].tolist() == plain_count[0].tolist() == [1] * llm.model.config.num_layers


def test_a_whole_prompt_through_it_is_the_python_layers_bits():
    llm = _dim32()
    if not llm.model.decoder_extends:
        pytest.skip("steps with prompt tokens take the Python layers here (no AMX)")
    ids, meta = llm.runner.meta(_chunks([37], 4, decode=False))
    (fused, fused_kv, _), (plain, plain_kv, _) = _same_step(llm, meta, ids)
    assert torch.equal(fused, plain) and torch.equal(fused_kv, plain_kv)


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
        llm.model.decoder.run(x, x.clone(), cos, sin, *tables, llm.kv_cache[:1], None, None)
    assert cpu.module() is not None


def _invariance_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(100, 20000, (n,), generator=g).tolist() for n in (300, 17, 90, 5)]


@pytest.mark.skipif(cpu.module() is None, reason="the C++ extension is not built here")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_greedy_tokens_are_the_same_alone_together_and_chunked(dtype):
    """batch_invariant: each prompt's greedy tokens and their log-probabilities, to the last bit, alone,
    beside the others (mixed steps) and with its prompt cut in 64-token chunks. Without it, on an AVX2
    EPYC, 3 (bf16) and 4 (fp32) of these four prompts' log-probabilities differed each way."""
    prompts, greedy = _invariance_prompts(), SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0)

    def tokens(outs):
        return [
            (
                o.outputs[0].token_ids,
                [d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)],
            )
            for o in outs
        ]

    with LLM("tiny-random", dtype=dtype, batch_invariant=True, num_pages=128) as llm:
        assert llm.model.decoder is None  # the C++ step's kernels differ by the batch: off
        alone = [tokens(llm.generate([p], greedy))[0] for p in prompts]
        together = tokens(llm.generate(prompts, greedy))
    with LLM(
        "tiny-random", dtype=dtype, batch_invariant=True, num_pages=128, max_num_batched_tokens=64
    ) as llm:
        chunked = tokens(llm.generate(prompts, greedy))
    assert together == alone and chunked == alone


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            dict(model="tiny-random-moe"),
            "dense models without MoE, MLA or q/k norms so far; tiny-random-moe has MoE",
        ),
        (dict(model="tiny-random-deepseek"), "has MoE, MLA"),
        (
            dict(kv_layout="NHD"),
            "over an HND cache (pdkernels.invariant) so far; got device='cpu', kv_layout='NHD'",
        ),
        (dict(batch_invariant="yes"), "batch_invariant must be true or false, got 'yes'"),
    ],
)
def test_batch_invariant_where_it_does_not_hold_is_refused_naming_why(overrides, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        LLM(**{"model": "tiny-random", "batch_invariant": True, **overrides})


def test_batch_invariant_without_the_cpp_extension_is_refused_when_the_engine_is_made(monkeypatch):
    """Its attention and int8 rows are C++ only: without the extension the engine is refused as it is made
    (it used to fail at its first step, with a request in flight)."""
    monkeypatch.setenv("PDKERNELS_CPU_EXT", "0")
    with pytest.raises(ValueError, match=re.escape("batch_invariant needs pdkernels' C++ extension")):
        LLM("tiny-random", batch_invariant=True)
