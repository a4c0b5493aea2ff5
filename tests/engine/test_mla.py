"""DeepSeek-V2/V3 (latent attention + MoE) against transformers on the same weights, and the latent cache
under tensor parallelism: greedy tokens equal, with chunked prefill, the prefix cache, YaRN and both q
projections."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.weights import load_model
from tests.hf import hf_greedy

transformers = pytest.importorskip("transformers")

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "mscale": 0.8,
    "mscale_all_dim": 0.7,
    "beta_fast": 32,
    "beta_slow": 1,
}


def _deepseek(tmp_path, version: int, **overrides):
    """A tiny random DeepSeek saved by transformers (safetensors, its own names), without a tokenizer: 3
    layers, the first dense, then 8 experts, top 2, 4 groups (2 picked), one shared expert."""
    common = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 32,
        "q_lora_rank": 24,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 512,
        **overrides,
    }
    if version == 3:
        model = transformers.DeepseekV3ForCausalLM(
            transformers.DeepseekV3Config(norm_topk_prob=True, **common)
        )
    else:
        config = transformers.DeepseekV2Config(topk_method="group_limited_greedy", **common)
        model = transformers.DeepseekV2ForCausalLM(config)
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.1) + (p.dim() == 1))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # V3: the bias that moves the experts' choice
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    model.save_pretrained(tmp_path)
    return model.eval()


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, 17, 41)]
    return [*prompts, prompts[2][:24] + prompts[0]]  # shares 6 full pages of 4 with the 41-token prompt


@pytest.mark.parametrize(
    "version,overrides",
    [(3, {"rope_parameters": YARN}), (2, {"q_lora_rank": None})],
    ids=["v3-q_lora-yarn", "v2-q_proj"],
)
def test_deepseek_greedy_equals_transformers_with_chunked_prefill(tmp_path, version, overrides):
    hf = _deepseek(tmp_path, version, **overrides)
    llm = LLM(str(tmp_path), page_size=4, num_pages=128, max_num_batched_tokens=16)  # 41 tokens: 3 chunks
    m = llm.config.arch
    assert (m.num_kv_heads, m.head_dim, m.mla.kv_lora_rank, m.mla.q_lora_rank) == (
        1,
        40,
        32,
        overrides.get("q_lora_rank", 24),
    )
    assert m.moe.layers == (1, 2) and m.moe.scoring == ("sigmoid" if version == 3 else "softmax")
    assert llm.kv_cache.shape == (3, 128, 1, 1, 4, 40)  # one latent row per token: no K/V planes, no heads
    assert m.kv_bytes_per_token(4) == 3 * 40 * 4
    outs = llm.generate(_prompts(512), SamplingParams(max_tokens=8, ignore_eos=True))
    for out in outs:
        assert out.token_ids == hf_greedy(hf, out.prompt_token_ids, 8), len(out.prompt_token_ids)
    assert llm.allocator.num_cached > 0


def test_a_deepseek_folder_with_attention_bias_is_refused_naming_the_field(tmp_path):
    _deepseek(tmp_path, 3, num_hidden_layers=1, attention_bias=True)
    with pytest.raises(ValueError, match="attention_bias must be false"):
        load_model(str(tmp_path))


def test_the_latent_cache_is_replicated_and_tp2_gives_the_tp1_tokens():
    """Heads split over the ranks, every rank writes the same latent rows: the same tokens as one rank."""
    prompts = _prompts(1000)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    tp1 = LLM("tiny-random-deepseek", page_size=4, num_pages=96)
    want = [o.token_ids for o in tp1.generate(prompts, params)]
    with LLM("tiny-random-deepseek", tp=2, page_size=4, num_pages=96) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert load_model("tiny-random-deepseek", weights=False).config == tp1.config.arch


def test_triton_kernels_give_the_same_tokens_on_the_latent_cache():
    """The latent append and the absorbed decode kernel (interpreter) against the torch paths."""
    from pdkernels import ops

    prompts, params = [[5, 9, 2, 7, 1]], SamplingParams(max_tokens=3, ignore_eos=True)  # interpreted: slow
    want = [
        o.token_ids for o in LLM("tiny-random-deepseek", page_size=4, num_pages=16).generate(prompts, params)
    ]
    ops.set_backend("triton")  # the interpreter is on in tests
    try:
        llm = LLM("tiny-random-deepseek", page_size=4, num_pages=16)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        assert ops.resolve("mla_decode_attention", llm.kv_cache.device) == "triton"
    finally:
        ops.set_backend("torch")
    assert got == want


def test_the_checkpoints_own_mtp_layer_drafts_losslessly(tmp_path):
    """DeepSeek's MTP layer (model.layers.{num_hidden_layers}.*: latent attention and routed experts) read
    from the checkpoint by speculative_config={"method": "mtp"}: greedy tokens equal those without
    speculation; on a bigram target the echo head's drafts are all accepted (both verify paths run)."""
    from safetensors.torch import save_file

    from tests.heads import bigram, echo_head_weights

    _deepseek(tmp_path, 3)
    head = echo_head_weights(load_model(str(tmp_path)))
    save_file(
        {f"model.layers.3.{k}": w.contiguous() for k, w in head.items()}, str(tmp_path / "mtp.safetensors")
    )
    prompts, params = _prompts(512)[1:3], SamplingParams(max_tokens=10, ignore_eos=True)
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    for target in (lambda llm: llm, bigram):
        plain = target(LLM(str(tmp_path), page_size=4, num_pages=128))
        spec = target(LLM(str(tmp_path), page_size=4, num_pages=128, speculative_config=mtp))
        outs = spec.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, params)]
        drafted, accepted = (
            sum(getattr(o, k) for o in outs) for k in ("num_drafted_tokens", "num_accepted_tokens")
        )
        if target is bigram:
            assert accepted == drafted >= 2 * len(outs), (accepted, drafted)
