"""The cost model's arithmetic on hand-computed cases (round numbers, efficiencies of 1)."""

import pytest

from experiments.sim.cost import CostModel, Efficiency, transfer_time
from experiments.sim.hardware import HARDWARE, Hardware, hardware
from experiments.sim.models import MODELS, SimModel, sim_model

# 2 layers, hidden 8, 2 heads of 4 (MHA), MLP 16 (SwiGLU), vocab 10, 1 byte per parameter
TOY = SimModel(
    "toy", layers=2, hidden=8, heads=2, kv_heads=2, head_dim=4, intermediate=16, vocab=10, bytes_per_param=1
)
# 1000 FLOP/s, 100 B/s HBM, NVLink 10 B/s, NIC 5 B/s
HW = Hardware("toy", flops=1000, hbm_bw=100, hbm_bytes=1e6, nvlink_bw=10, nic_bw=5)
PERFECT = Efficiency(linear=1, attention=1, memory=1, comm=1)


def test_parameter_and_kv_counts_by_hand():
    # per layer: q 8x8 + k,v 2x(8x8) + o 8x8 = 256; MLP 3 x 8 x 16 = 384 -> 640;
    # two layers 1280; embedding + head 160
    assert TOY.attn_params() == 256 and TOY.layer_params(0, active=False) == 640
    assert TOY.params() == 1280 + 160
    assert TOY.kv_bytes_per_token() == 2 * 2 * 2 * 4  # layers x K,V x heads x dim x 1 byte


def test_presets_match_the_published_sizes():
    sizes = {name: m.params() / 1e9 for name, m in MODELS.items()}
    assert sizes["llama-3-8b"] == pytest.approx(8.03, abs=0.01)
    assert sizes["llama-3-70b"] == pytest.approx(70.6, abs=0.1)
    assert sizes["opt-13b"] == pytest.approx(12.85, abs=0.02)
    assert sizes["qwen3-coder-480b-a35b"] == pytest.approx(480, abs=1)
    assert MODELS["qwen3-coder-480b-a35b"].params(active=True) / 1e9 == pytest.approx(35, abs=1)
    assert sizes["deepseek-r1"] == pytest.approx(671, abs=1)
    assert MODELS["deepseek-r1"].params(active=True) / 1e9 == pytest.approx(37, abs=1)
    assert MODELS["deepseek-r1"].kv_bytes_per_token() == 61 * 576 * 2  # MLA latent + rope key, bf16
    assert HARDWARE["h200"].hbm_bw == 4.8e12 and HARDWARE["a100-80gb"].flops == 312e12


def test_decode_of_one_token_is_bound_by_reading_the_weights():
    cm = CostModel(TOY, HW, eff=PERFECT)
    # linear: 1280 bytes / 100 B/s = 12.8 s (FLOPs 2 x 1280 = 2560 -> 2.56 s: memory-bound)
    assert cm.linear_time(1) == pytest.approx(12.8)
    # attention over 9 cached + 1 new: KV bytes 10 x 32 = 320 -> 3.2 s
    assert cm.attention_time(1, 9) == pytest.approx(3.2)
    # LM head: 80 bytes -> 0.8 s
    assert cm.decode_time([9]) == pytest.approx(12.8 + 3.2 + 0.8)


def test_a_long_prefill_is_bound_by_flops():
    cm = CostModel(TOY, HW, eff=PERFECT)
    # 1000 tokens: linear FLOPs 2 x 1000 x 1280 = 2.56e6 -> 2560 s (bytes 12.8 s)
    assert cm.linear_time(1000) == pytest.approx(2560)
    # causal pairs 1000 x 1001 / 2 = 500500; FLOPs 2 x pairs x heads 2 x (4 + 4) x layers 2
    assert cm.attention_time(1000, 0) == pytest.approx(2 * 500500 * 2 * 8 * 2 / 1000)


def test_tp_splits_the_work_and_adds_two_all_reduces_per_layer():
    one, two = CostModel(TOY, HW, eff=PERFECT), CostModel(TOY, HW, tp=2, eff=PERFECT)
    assert two.linear_time(1000) == pytest.approx(one.linear_time(1000) / 2)
    # 10 tokens x 8 wide x 1 byte = 80 bytes; ring: 2 x (2-1)/2 x 80 / 10 B/s = 8 s; 2 per layer x 2 layers
    assert two.allreduce_time(10) == pytest.approx(32)
    assert one.allreduce_time(10) == 0


def test_moe_reads_only_the_experts_its_tokens_touch():
    moe = SimModel(
        "moe", 1, 8, 2, 2, 4, 16, 10, experts=4, active_experts=1, expert_intermediate=16, bytes_per_param=1
    )
    cm = CostModel(moe, HW, eff=PERFECT)
    # one token touches 1 of 4 experts: 256 attention + 384 expert bytes
    assert cm.weights_read(1) == pytest.approx(640)
    # many tokens touch all four
    assert cm.weights_read(10_000) == pytest.approx(256 + 4 * 384)


def test_kv_per_rank_sharded_replicated_and_mla():
    assert CostModel(TOY, HW, tp=2).kv_bytes_per_token_per_rank() == 16
    gqa = SimModel("gqa", 1, 8, 4, 1, 2, 16, 10, bytes_per_param=1)  # one kv head, TP 4: replicated
    assert CostModel(gqa, HW, tp=4).kv_bytes_per_token_per_rank() == gqa.kv_bytes_per_token()
    r1 = MODELS["deepseek-r1"]
    assert CostModel(r1, HARDWARE["h200"], tp=8).kv_bytes_per_token_per_rank() == r1.kv_bytes_per_token()


def test_a_transfer_takes_the_kv_over_the_links_at_their_efficiency():
    # 100 bytes over 2 NICs of 5 B/s: 10 s (what of it shows after the prefill: test_simulate.py)
    assert transfer_time(100, HW, links=2, eff=PERFECT) == pytest.approx(10)
    assert transfer_time(100, HW, links=2, eff=Efficiency(comm=0.5)) == pytest.approx(20)


def test_bad_names_and_values_are_refused():
    with pytest.raises(ValueError, match="hardware must be one of"):
        hardware("tpu")
    with pytest.raises(ValueError, match="sim model must be one of"):
        sim_model("gpt-5")
    with pytest.raises(ValueError, match="efficiency.memory must be in"):
        Efficiency(memory=0)
    with pytest.raises(ValueError, match="efficiency.seq_overhead_s must be >= 0"):
        Efficiency(seq_overhead_s=-1)
    with pytest.raises(ValueError, match="dp=0 must be >= 1"):
        CostModel(TOY, HW, dp=0)
    with pytest.raises(ValueError, match="tp=3 must be >= 1 and divide the 2 heads"):
        CostModel(TOY, HW, tp=3)


MOE = SimModel(
    "moe", 1, 8, 2, 2, 4, 16, 10, experts=4, active_experts=1, expert_intermediate=16, bytes_per_param=1
)


def test_dp_attention_replicates_the_attention_side_and_spreads_the_experts():
    """One layer: attention 256 weights, four experts of 384 (one active); embeddings 160; 10,000 tokens
    touch every expert."""
    one, dp2 = CostModel(MOE, HW, eff=PERFECT), CostModel(MOE, HW, eff=PERFECT, dp=2)
    # dp 1: FLOPs 2 x 10,000 x (256 + 384) = 12.8e6 -> 12,800 s
    assert one.linear_time(10_000) == pytest.approx(12_800)
    # dp 2: each rank runs attention for 5,000 tokens and half of all tokens' expert FLOPs:
    # 2 x 5,000 x 256 + 2 x 10,000 x 384 / 2 = 6.4e6 -> 6,400 s
    assert dp2.linear_time(10_000) == pytest.approx(6_400)
    # one token: bytes-bound; attention side 256 read in full, its one expert over 2 ranks: 256 + 192
    assert dp2.linear_time(1) == pytest.approx((256 + 384 / 2) / 100)
    # a rank holds the attention side and embeddings (416) and half the experts (768)
    assert one.weight_bytes_per_rank() == 416 + 1536 and dp2.weight_bytes_per_rank() == 416 + 768
    # all-to-all: a rank sends its 5 of 10 tokens x 1 expert x 8 wide x 1 byte = 40 B, half of it off-rank,
    # at 10 B/s: 2 s; dispatch and combine in the one MoE layer: 4 s
    assert dp2.alltoall_time(10) == pytest.approx(4) and one.alltoall_time(10) == 0
    # attention of a decode batch splits over the dp groups
    assert dp2.step_time([], [3, 5]) - dp2.decode_attention_time([3, 5]) / 2 == pytest.approx(
        dp2.linear_time(2) + dp2.lm_head_time(2) + dp2.alltoall_time(2)
    )


def test_decode_attention_of_a_batch_is_the_sum_of_its_sequences():
    cm = CostModel(TOY, HW, eff=PERFECT)
    assert cm.decode_attention_time([3, 5, 40]) == pytest.approx(
        sum(cm.attention_time(1, k) for k in (3, 5, 40))
    )
    assert cm.decode_attention_time([]) == 0


def test_per_sequence_overhead_counts_every_chunk_and_decode_sequence():
    base = CostModel(TOY, HW, eff=PERFECT)
    slow = CostModel(TOY, HW, eff=Efficiency(1, 1, 1, 1, step_overhead_s=2, seq_overhead_s=0.5))
    assert slow.step_time([(4, 0)], [3, 5]) == pytest.approx(base.step_time([(4, 0)], [3, 5]) + 2 + 3 * 0.5)


@pytest.mark.parametrize("name", ["tiny-random-deepseek", "tiny-random-moe", "tiny-random"])
def test_the_cost_models_view_of_an_engine_model_has_its_weights_and_kv_rows(name):
    """sim_model of an engine model (MLA, MoE with a shared expert and a dense first layer, GQA): the
    matrices the engine loads (norms and routers aside) are the parameters the cost model reads, and the
    KV rows a token adds are the engine cache's."""
    from engine.weights import load_model

    loaded, sim = load_model(name), sim_model(name)
    matrices = sum(
        w.numel() for k, w in loaded.weights.items() if w.dim() == 2 and not k.endswith("mlp.gate.weight")
    )
    assert sim.params() == matrices
    assert sim.kv_bytes_per_token() == loaded.config.kv_bytes_per_token(2)
    active = sim.params(active=True)
    assert (active < sim.params()) == (loaded.config.moe is not None)
