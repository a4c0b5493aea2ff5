"""MTP draft heads for tests (engine/mtp.py): a random one (drafts almost never accepted) is the config's
`model: random`; the "echo" head here drafts what a model whose layers add nothing would say next.

The echo head passes the embedding of the token it is given straight through (eh_proj = [I 0], enorm = 1,
its layer's o_proj and down_proj zero) and ends with the target's final norm: it drafts
argmax(lm_head(norm(embed(t)))), the token a target with zeroed layers ("bigram(llm)") samples after t. On
such a target every draft is accepted; on tiny-random, whose tied embeddings dominate its small random
layers, most are, and some are not (both paths of verification).
"""

from pathlib import Path

import torch
from safetensors.torch import save_file

from engine import LLM
from engine.mtp import random_head_weights
from engine.weights import load_model


def echo_head_weights(loaded) -> dict[str, torch.Tensor]:
    """The echo head for a loaded model (bare names): its layer's outputs zero, whatever its kind."""
    h = loaded.config.hidden_size
    head = random_head_weights(loaded.config)
    head["enorm.weight"] = torch.ones(h)
    head["eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], 1)
    for key, w in head.items():  # o_proj, and the dense MLP's or every expert's down projection
        if key == "self_attn.o_proj.weight" or key.endswith("down_proj.weight"):
            w.zero_()
    head["shared_head.norm.weight"] = loaded.weights["model.norm.weight"].clone()
    return head


def echo_head(path: Path, model: str = "tiny-random") -> str:
    head = echo_head_weights(load_model(model))
    save_file({k: w.contiguous() for k, w in head.items()}, str(path))
    return str(path)


def bigram(llm: LLM) -> LLM:
    """Zero llm's attention and MLP outputs (lead rank only): its next token depends on its last one."""
    for layer in llm.model.layers:
        for key in ("o", "down", "experts_down", "shared_down"):  # plain or prepacked: zeros in any layout
            if key in layer:
                getattr(layer[key], "data", layer[key]).zero_()
    return llm


def record_head_inputs(llm: LLM) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per request, the first row the MTP head combines: (embedding of the token, target hidden state)."""
    seen, current = {}, []
    drafter = llm.core.drafter
    propose, combine = drafter.propose, drafter.combine

    def proposing(seq):
        current[:] = [seq.request_id]
        return propose(seq)

    def combining(embedded, hidden):
        seen.setdefault(current[0], (embedded[0].clone(), hidden[0].clone()))
        return combine(embedded, hidden)

    llm.scheduler.propose, drafter.combine = proposing, combining
    return seen
