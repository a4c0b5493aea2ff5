"""What a model is, as the engine reads it: attention kind, experts, and the KV one token costs.

    python -m engine.info tiny-random-deepseek random-deepseek-v3 smollm2-135m path/to/hf-folder

reads each model's config (no weights) and prints one Markdown row per model. The KV bytes are the cache
rows one token adds (all layers, whole model; in bf16), what one TP rank holds of them (a GQA cache is
cut by kv heads, an MLA latent cache is the same on every rank: the replica, not a shard, moves), what
all --tp ranks of a TP instance hold together, and what they hold as --tp DP groups of one rank
(data-parallel attention, engine/dp.py: a token's KV lives whole on its own group's rank, once).
"""

from __future__ import annotations

import argparse

from engine.config import ModelConfig
from engine.weights import load_model

BF16 = 2


def describe(config: ModelConfig, tp: int = 8) -> dict:
    attention = (
        f"MLA (latent {config.mla.kv_lora_rank} + rope {config.mla.qk_rope_head_dim})"
        if config.mla
        else f"GQA ({config.num_heads} q / {config.num_kv_heads} kv heads x {config.head_dim})"
    )
    moe = config.moe
    experts = f"{moe.num_experts} x {moe.intermediate_size}, top {moe.top_k}" if moe else "dense"
    if moe and moe.num_shared_experts:
        experts += f", {moe.num_shared_experts} shared"
    per_token = config.kv_bytes_per_token(BF16)
    shards = 1 if config.mla else min(tp, config.num_kv_heads)  # fewer kv heads than ranks: replicated
    return {
        "model": config.name,
        "layers": config.num_layers,
        "attention": attention,
        "MLP": experts,
        "KV B/token/layer": per_token // config.num_layers,
        "KV B/token": per_token,
        f"per rank at TP {tp}": per_token // shards,
        f"all ranks at TP {tp}": per_token // shards * tp,
        f"per DP rank (all ranks) at DP {tp}": per_token,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("models", nargs="+", help="registered names, .gguf files or Hugging Face folders")
    parser.add_argument(
        "--tp", type=int, default=8, help="TP (and DP) degree of the per-rank columns (default 8)"
    )
    args = parser.parse_args(argv)
    if args.tp < 1:
        parser.error(f"--tp must be >= 1, got {args.tp}")
    rows = [describe(load_model(name, weights=False).config, args.tp) for name in args.models]
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + " --- |" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(f"{v:,}" if isinstance(v, int) else str(v) for v in row.values()) + " |")


if __name__ == "__main__":
    main()
