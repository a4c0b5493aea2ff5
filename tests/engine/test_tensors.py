"""Seeded random weights (engine/tensors.py): the same values whatever the order they are read in, each
read a tensor of its own (a reader may change it in place), and the process keeps no more drawn tensors
than its bound."""

import torch

from engine import tensors
from engine.config import ModelConfig


def _config(vocab=4096):
    return ModelConfig(
        name="t", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-5, max_position=256,
        tie_embeddings=True, bos_token_id=None, eos_token_ids=(0,),
    )  # fmt: skip


def test_a_tensor_read_again_is_the_same_values_in_storage_of_its_own(monkeypatch):
    monkeypatch.setattr(tensors, "_drawn", type(tensors._drawn)())
    weights = tensors.random_weights(_config(), seed=3)
    names = sorted(weights)
    first = {n: weights[n] for n in names}
    first["model.embed_tokens.weight"].zero_()  # a reader that quantizes or shards in place
    again = {n: weights[n] for n in reversed(names)}
    fresh = {n: tensors._draw(3, n, weights.specs[n]) for n in names}
    assert all(torch.equal(again[n], fresh[n]) for n in names)
    assert again["model.embed_tokens.weight"].abs().sum() > 0
    assert all(again[n].data_ptr() != first[n].data_ptr() for n in names)
    other = tensors.random_weights(_config(), seed=4)
    assert not torch.equal(other["model.embed_tokens.weight"], again["model.embed_tokens.weight"])


def test_the_drawn_tensors_kept_stay_within_their_bound(monkeypatch):
    monkeypatch.setattr(tensors, "_drawn", type(tensors._drawn)())
    monkeypatch.setattr(tensors, "DRAWN_BYTES", 1 << 20)  # a model's layers are 0.3 MiB of fp32 below
    for seed in range(8):
        weights = tensors.random_weights(_config(vocab=4096), seed=seed)
        for name in weights:
            weights[name]
        held = sum(t.numel() * t.element_size() for t in tensors._drawn.values())
        assert held <= 1 << 20
    assert all(key[1] != "model.embed_tokens.weight" for key in tensors._drawn)  # over a quarter: never
    assert any(key[0] == 7 for key in tensors._drawn)  # the latest kept, the first ones dropped
    assert not any(key[0] == 0 for key in tensors._drawn)
