"""Mixture of experts: the router and the routed experts, as one building block of the model.

The router scores every expert per token and keeps the top k; the experts then run grouped, not per
token: the (token, expert) pairs are sorted by expert, and each expert that received tokens runs one
gate/up GEMM and one down GEMM over its rows. The weighted rows are summed back into their tokens with one
index_add. Under tensor parallelism each rank holds the same slice of every expert's MLP width (as for the
dense MLP), so the experts' partial outputs are summed by the all-reduce the dense MLP already does. With
expert parallelism (EngineConfig.expert_parallel) each rank holds num_experts / tp whole experts instead
and runs only the (token, expert) pairs routed to them: every rank already has every token (attention's
all-reduce gave them the same hidden states), so the dispatch is each rank picking its own pairs and the
combine is that same all-reduce; the shared experts stay split by width.

With data-parallel attention (EngineConfig.dp, engine/dp.py) each DP group holds its own tokens, so the
routed experts, spread over all tp x dp ranks, are reached through an all-to-all (`dispatch`): each rank
routes its share of its group's tokens (a TP rank its slice of them), sends each (token, expert) pair's
row to the rank holding that expert, runs the rows it received through its experts and sends them back,
where they are weighted and summed into their tokens; the group's TP all-reduce then joins the slices. A
DP group without tokens this step still takes part, with none (every rank must join each all-to-all).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from engine.config import MoEConfig


def route(x: Tensor, router: Tensor, moe: MoEConfig, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [T, H], router [E, H] -> (weights [T, k], expert ids [T, k]), as transformers' routers for
    Qwen3-MoE and DeepSeek-V2/V3 (MoEConfig says which). bias [E]: DeepSeek-V3's e_score_correction_bias,
    which moves the choice and not the weights. Weights are fp32 for an fp32 router, else in x's dtype."""
    logits = F.linear(x.float(), router.float()) if moe.fp32_router else F.linear(x, router)
    scores = logits.sigmoid() if moe.scoring == "sigmoid" else logits.softmax(dim=-1, dtype=torch.float32)
    choice = scores if bias is None else scores + bias
    if moe.topk_method != "greedy":  # group-limited: only the experts of the topk_group best groups
        grouped = choice.view(-1, moe.num_groups, moe.num_experts // moe.num_groups)
        if moe.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(moe.topk_group, dim=-1).indices, True)
        dropped = ~keep.repeat_interleave(moe.num_experts // moe.num_groups, dim=1)
        choice = choice.masked_fill(dropped, float("-inf") if moe.topk_method == "noaux_tc" else 0.0)
    ids = choice.topk(moe.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return (weights if moe.fp32_router else weights.to(x.dtype)), ids


def experts(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, first: int = 0) -> Tensor:
    """x [T, H]; weights, ids [T, k]; gate_up [E, 2F, H] (gate rows then up rows), down [E, H, F] ->
    [T, H]: sum over each token's k experts of weight * down(silu(gate) * up). The tensors hold experts
    first .. first + E - 1 (all of them, or one rank's under expert parallelism): pairs routed to other
    experts are left to their ranks."""
    k, num = ids.shape[1], gate_up.shape[0]
    flat = ids.reshape(-1) - first
    mine = ((flat >= 0) & (flat < num)).nonzero().squeeze(1)
    order = mine[torch.argsort(flat[mine], stable=True)]  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat[mine], minlength=num).tolist()
    token = order // k
    rows = x[token]
    out = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n:
            gate, up = F.linear(rows[start : start + n], gate_up[e]).chunk(2, dim=-1)
            torch.mm(F.silu(gate) * up, down[e].t(), out=out[start : start + n])
            start += n
    out = out * weights.reshape(-1)[order].unsqueeze(1)  # fp32 weights: the product in fp32, as transformers
    return torch.zeros_like(x).index_add_(0, token, out.to(x.dtype))


def experts_ref(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """The specification: every token through each of its k experts, one at a time."""
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            gate, up = F.linear(x[t], gate_up[e]).chunk(2, dim=-1)
            y[t] += w * F.linear(F.silu(gate) * up, down[e])
    return y


def load_experts(
    weights: dict[str, Tensor],
    prefix: str,
    moe: MoEConfig,
    lo: int,
    hi: int,
    experts: tuple[int, int] | None = None,
) -> dict:
    """An MoE layer's tensors for this rank, from Hugging Face's per-expert names
    (`{prefix}experts.{e}.gate_proj.weight`, ...): the router (and DeepSeek-V3's score bias) whole; the
    slice [lo, hi) of every expert's MLP width, stacked (gate_up [E, 2F, H], down [E, H, F]), or with
    experts=(start, end) (expert parallelism) those experts whole; and the [lo, hi) share of the shared
    experts' width."""

    def w(e, name):
        return weights[f"{prefix}experts.{e}.{name}.weight"]

    first, last = experts or (0, moe.num_experts)
    a, b = (0, moe.intermediate_size) if experts else (lo, hi)
    gate_up = torch.stack(
        [torch.cat([w(e, "gate_proj")[a:b], w(e, "up_proj")[a:b]]) for e in range(first, last)]
    )
    down = torch.stack([w(e, "down_proj")[:, a:b] for e in range(first, last)])
    layer = {"router": weights[prefix + "gate.weight"], "experts_gate_up": gate_up, "experts_down": down}
    if prefix + "gate.e_score_correction_bias" in weights:
        layer["router_bias"] = weights[prefix + "gate.e_score_correction_bias"]
    if moe.num_shared_experts:
        n = moe.num_shared_experts
        shared = {
            k: weights[f"{prefix}shared_experts.{k}.weight"] for k in ("gate_proj", "up_proj", "down_proj")
        }
        layer["shared_gate_up"] = torch.cat(
            [shared["gate_proj"][lo * n : hi * n], shared["up_proj"][lo * n : hi * n]]
        )
        layer["shared_down"] = shared["down_proj"][:, lo * n : hi * n]
    return layer


def forward(layer: dict, x: Tensor, moe: MoEConfig, shard=None) -> Tensor:
    """An MoE layer's MLP output for x [T, H] (this rank's partial sum under TP); shard: this rank's
    engine.model.Shard (which experts the layer's tensors hold; data-parallel attention: dispatch), None
    for a layer holding every expert."""
    if shard is not None and shard.dp > 1:
        y = dispatch(layer, x, moe, shard)
    else:
        weights, ids = route(x, layer["router"], moe, layer.get("router_bias"))
        first = shard.experts[0] if shard is not None and shard.experts else 0
        y = experts(x, weights, ids, layer["experts_gate_up"], layer["experts_down"], first)
    if "shared_gate_up" in layer:
        gate, up = F.linear(x, layer["shared_gate_up"]).chunk(2, dim=-1)
        y = y + F.linear(F.silu(gate) * up, layer["shared_down"])
    return y


def dispatch(layer: dict, x: Tensor, moe: MoEConfig, shard) -> Tensor:
    """Data-parallel attention: the routed experts' output for x [T, H], this DP group's tokens (the same
    on each of its TP ranks), through the all-to-all over every rank (shard: this rank's engine.model.
    Shard). This TP rank sends its slice of the rows and returns them summed there, zeros elsewhere (the
    group's all-reduce adds the other slices). T may be 0: a group without tokens still takes part."""
    world, k = shard.size * shard.dp, moe.top_k
    lo, hi = shard.rank * x.shape[0] // shard.size, (shard.rank + 1) * x.shape[0] // shard.size
    mine = x[lo:hi]
    if mine.shape[0]:
        weights, ids = route(mine, layer["router"], moe, layer.get("router_bias"))
    else:  # routing an empty batch: group-limited routing cannot reshape 0 rows
        ids = torch.empty((0, k), dtype=torch.long, device=x.device)
        weights = torch.empty((0, k), dtype=torch.float32 if moe.fp32_router else x.dtype, device=x.device)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs by expert, so by the rank holding it
    per = moe.num_experts // world
    send = torch.bincount(flat[order] // per, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    sent, got = send.tolist(), recv.tolist()
    # gloo moves no bf16 (and sums none): rows travel in fp32 on the CPU, where bf16 widens exactly
    wire = torch.float32 if x.dtype == torch.bfloat16 and x.device.type == "cpu" else x.dtype
    hidden = x.shape[1]
    if wire == torch.float32:  # each row carries its expert's id as one more column (exact below 2**24)
        packed = torch.cat([mine[order // k].to(wire), flat[order].unsqueeze(1).to(wire)], dim=1)
        rows = x.new_empty((sum(got), hidden + 1), dtype=wire)
        dist.all_to_all_single(rows, packed, got, sent)
        rows, their = rows[:, :hidden], rows[:, hidden].long()
    else:
        rows = x.new_empty((sum(got), hidden), dtype=wire)
        dist.all_to_all_single(rows, mine[order // k].to(wire), got, sent)
        their = torch.empty(sum(got), dtype=torch.long, device=x.device)
        dist.all_to_all_single(their, flat[order], got, sent)
    ones = torch.ones((len(their), 1), dtype=weights.dtype, device=x.device)
    done = experts(rows.to(x.dtype), ones, their.unsqueeze(1), layer["experts_gate_up"],
                   layer["experts_down"], shard.experts[0])  # fmt: skip
    back = x.new_empty((len(order), hidden), dtype=wire)
    dist.all_to_all_single(back, done.to(wire), sent, got)
    # as experts(): fp32 weights make the product fp32
    out = back.to(x.dtype) * weights.reshape(-1)[order].unsqueeze(1)
    y = torch.zeros_like(x)
    y[lo:hi].index_add_(0, order // k, out.to(x.dtype))
    return y
