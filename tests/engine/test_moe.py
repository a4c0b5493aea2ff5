"""Mixture of experts: the grouped experts against their one-token-at-a-time specification, Qwen3-MoE
against transformers on the same weights, and under tensor parallelism."""

from dataclasses import replace

import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutputs
from engine.config import EngineConfig, MoEConfig
from engine.model import Shard
from engine.moe import experts, experts_ref, route
from engine.weights import load_model
from tests.hf import hf_greedy

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_grouped_experts_equal_each_token_through_its_experts(tokens):
    g = torch.Generator().manual_seed(tokens)
    e, h, f = 8, 32, 16
    moe = MoEConfig(num_experts=e, top_k=3, intermediate_size=f, layers=(0,))
    x = torch.randn(tokens, h, generator=g)
    router = torch.randn(e, h, generator=g)
    gate_up = torch.randn(e, 2 * f, h, generator=g) * h**-0.5
    down = torch.randn(e, h, f, generator=g) * f**-0.5
    weights, ids = route(x, router, moe)
    assert ids.shape == (tokens, 3) and torch.allclose(weights.sum(-1), torch.ones(tokens))
    got, want = experts(x, weights, ids, gate_up, down), experts_ref(x, weights, ids, gate_up, down)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32: only the order of sums differs


def test_route_picks_the_highest_scores_and_renormalises_only_when_asked():
    x = torch.eye(4)
    router = torch.diag(torch.tensor([4.0, 3.0, 2.0, 1.0]))  # token t scores expert t highest
    for norm in (True, False):
        moe = MoEConfig(num_experts=4, top_k=2, intermediate_size=4, layers=(0,), norm_topk_prob=norm)
        weights, ids = route(x, router, moe)
        assert ids[:, 0].tolist() == [0, 1, 2, 3]
        assert torch.allclose(weights.sum(-1), torch.ones(4)) == norm


def _qwen3_moe(tmp_path, **overrides):
    """A tiny random Qwen3-MoE saved by transformers (safetensors, its own names), without a tokenizer."""
    config = transformers.Qwen3MoeConfig(
        **{
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
            "max_position_embeddings": 512,
            **overrides,
        }
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)
    model.save_pretrained(tmp_path)
    return model.eval()


PROMPT_LENGTHS = (3, 17, 41)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize(
    "overrides",
    [{}, {"norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": []}],
    ids=["dense-first-layer", "every-second-layer-unnormalised"],
)
def test_qwen3_moe_greedy_equals_transformers_with_chunked_prefill(tmp_path, overrides):
    hf = _qwen3_moe(tmp_path, **overrides)
    llm = LLM(str(tmp_path), page_size=4, num_pages=96, max_num_batched_tokens=16)  # 41 tokens: 3 chunks
    moe = llm.config.arch.moe
    sparse = [
        i
        for i in range(3)
        if i not in hf.config.mlp_only_layers and (i + 1) % hf.config.decoder_sparse_step == 0
    ]
    assert (moe.num_experts, moe.top_k, moe.layers) == (8, 2, tuple(sparse))
    assert llm.config.arch.qk_norm and moe.norm_topk_prob == hf.config.norm_topk_prob
    assert load_model(str(tmp_path), weights=False).config == llm.config.arch  # what a driver reads
    outs = llm.generate(_prompts(512), SamplingParams(max_tokens=8, ignore_eos=True))
    for out in outs:
        assert out.token_ids == hf_greedy(hf, out.prompt_token_ids, 8), len(out.prompt_token_ids)
        assert out.text == ""  # no tokenizer.json: token ids in and out


def test_a_folder_without_a_tokenizer_refuses_text_naming_what_is_missing(tmp_path):
    _qwen3_moe(tmp_path, num_hidden_layers=1)
    llm = LLM(str(tmp_path), page_size=4, num_pages=16)
    with pytest.raises(ValueError, match="no tokenizer.json: pass token ids"):
        llm.generate("some text", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="a chat needs a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))
    grammar = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputs(choice=["yes", "no"]))
    with pytest.raises(ValueError, match="structured_outputs needs a tokenizer"):
        llm.generate([[1, 2, 3]], grammar)
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids) == 2


def test_tp_must_divide_the_experts_width():
    model = load_model("tiny-random-moe").config
    model = replace(model, moe=replace(model.moe, intermediate_size=66))
    with pytest.raises(ValueError, match="tp=4 must divide the experts' MLP width 66"):
        EngineConfig(arch=model, tp=4)
    with pytest.raises(ValueError, match=r"moe.layers must be in \[0, 4\), got \[4\]"):
        replace(model, moe=replace(model.moe, layers=(1, 4)))
    with pytest.raises(ValueError, match=r"moe.top_k must be in \[1, num_experts=4\]"):
        MoEConfig(num_experts=4, top_k=5, intermediate_size=8, layers=(0,))


@pytest.mark.parametrize("tp", [2])
def test_moe_under_tensor_parallelism_gives_the_tp1_tokens(tp):
    prompts = _prompts(1000)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in LLM("tiny-random-moe", page_size=4, num_pages=64).generate(prompts, params)]
    with LLM("tiny-random-moe", tp=tp, page_size=4, num_pages=64) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == want


def _deepseek_moe_block(version: int, **overrides):
    """transformers' own DeepSeek MoE block (router, experts, shared experts) with seeded random weights,
    and the same weights under the checkpoint's names (per expert), as our loader reads them."""
    common = dict(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3)
    common.update(n_shared_experts=1, routed_scaling_factor=2.5, n_group=4, topk_group=2, **overrides)
    if version == 3:
        module = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(
            transformers.DeepseekV3Config(norm_topk_prob=True, **common)
        )
    else:
        module = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe(
            transformers.DeepseekV2Config(topk_method="group_limited_greedy", **common)
        )
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            t.copy_(torch.randn(t.shape, generator=g) * (0.3 if t.dim() > 1 else 0.1))
    state = module.state_dict()
    f = common["moe_intermediate_size"]
    names = {"gate.weight": state["gate.weight"]}
    if "gate.e_score_correction_bias" in state:
        names["gate.e_score_correction_bias"] = state["gate.e_score_correction_bias"]
    for e in range(common["n_routed_experts"]):
        names[f"experts.{e}.gate_proj.weight"] = state["experts.gate_up_proj"][e, :f]
        names[f"experts.{e}.up_proj.weight"] = state["experts.gate_up_proj"][e, f:]
        names[f"experts.{e}.down_proj.weight"] = state["experts.down_proj"][e]
    for k in ("gate_proj", "up_proj", "down_proj"):
        names[f"shared_experts.{k}.weight"] = state[f"shared_experts.{k}.weight"]
    moe = MoEConfig(
        num_experts=8,
        top_k=3,
        intermediate_size=f,
        layers=(0,),
        norm_topk_prob=version == 3,
        scoring="sigmoid" if version == 3 else "softmax",
        topk_method="noaux_tc" if version == 3 else "group_limited_greedy",
        num_groups=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        num_shared_experts=1,
        fp32_router=True,
    )
    return module.eval(), names, moe


@pytest.mark.parametrize("version", [2, 3])
def test_deepseek_moe_equals_transformers_whole_and_summed_over_tp_slices(version):
    """DeepSeek-V3's routing (sigmoid scores, the score-correction bias moving only the choice, groups
    ranked by their two best experts) and V2's (softmax, groups by their best), shared experts and the
    routed scaling factor, against transformers' blocks; two TP ranks' slices sum to the whole."""
    from engine import moe as moe_block

    module, names, moe = _deepseek_moe_block(version)
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = module(x.unsqueeze(0))[0]
    whole = moe_block.forward(moe_block.load_experts(names, "", moe, 0, 16), x, moe)
    torch.testing.assert_close(whole, want, rtol=1e-5, atol=1e-5)
    ranks = [moe_block.forward(moe_block.load_experts(names, "", moe, lo, lo + 8), x, moe) for lo in (0, 8)]
    torch.testing.assert_close(ranks[0] + ranks[1], want, rtol=1e-5, atol=1e-5)
    if version == 3:  # the bias decides: without it other experts win for some tokens
        _, with_bias = moe_block.route(x, names["gate.weight"], moe, names["gate.e_score_correction_bias"])
        _, without = moe_block.route(x, names["gate.weight"], moe)
        assert (with_bias.sort().values != without.sort().values).any()


def test_moe_config_names_the_bad_field():
    for kwargs, field in [
        ({"scoring": "relu"}, "moe.scoring must be one of"),
        ({"topk_method": "best"}, "moe.topk_method must be one of"),
        ({"num_groups": 3}, "moe.num_groups must divide num_experts=8"),
        ({"num_groups": 4, "topk_group": 5}, r"moe.topk_group must be in \[1, num_groups=4\]"),
        ({"num_groups": 8, "topk_method": "noaux_tc"}, "each group needs >= 2"),
    ]:
        with pytest.raises(ValueError, match=field):
            MoEConfig(num_experts=8, top_k=2, intermediate_size=8, layers=(0,), **kwargs)


def test_an_moe_model_refuses_cuda_graphs_naming_why():
    """The experts' grouping reads per-expert counts on the host, which a graph capture cannot: MoE models
    decode eagerly (the default), and asking for graphs is a clear error."""
    with pytest.raises(ValueError, match="a model without MoE or MLA layers.*moe=True"):
        LLM("tiny-random-moe", page_size=4, num_pages=16, cuda_graphs=True)


@pytest.mark.parametrize("model", ["tiny-random-deepseek"])  # its shared expert stays split by width
def test_expert_parallelism_gives_the_tp1_tokens(model):
    """Whole experts per rank (4 of 8 each), each rank running only the pairs routed to its own, the
    all-reduce combining them: the tokens of one rank holding everything."""
    prompts = _prompts(1000)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in LLM(model, page_size=4, num_pages=96).generate(prompts, params)]
    with LLM(model, tp=2, expert_parallel=True, page_size=4, num_pages=96) as llm:
        assert llm.model.shard.experts == (0, 4) and llm.model.layers[1]["experts_down"].shape[0] == 4
        assert [o.token_ids for o in llm.generate(prompts, params)] == want


def test_deepseek_moe_over_expert_parallel_ranks_sums_to_the_whole():
    """Two ranks of 4 whole experts each (the shared expert split by width) sum to transformers' block."""
    from engine import moe as moe_block

    module, names, moe = _deepseek_moe_block(3)
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = module(x.unsqueeze(0))[0]
    ranks = [
        moe_block.forward(
            moe_block.load_experts(names, "", moe, lo, lo + 8, (first, first + 4)),
            x,
            moe,
            Shard(rank, 2, (0, 0), (0, 0), (0, 0), (lo, lo + 8), (first, first + 4)),
        )
        for rank, (lo, first) in enumerate(((0, 0), (8, 4)))
    ]
    torch.testing.assert_close(ranks[0] + ranks[1], want, rtol=1e-5, atol=1e-5)


def test_expert_parallel_is_checked_naming_the_field():
    model = load_model("tiny-random-moe", weights=False).config
    model = replace(model, moe=replace(model.moe, num_experts=6))
    with pytest.raises(ValueError, match="whose experts tp=4 divides; got 6"):
        EngineConfig(arch=model, tp=4, expert_parallel=True)
    with pytest.raises(ValueError, match="expert_parallel needs an MoE model"):
        EngineConfig(arch=load_model("tiny-random", weights=False).config, expert_parallel=True)
