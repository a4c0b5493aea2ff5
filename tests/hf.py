"""transformers as the reference the engine is checked against (a test-only dependency)."""

import torch


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """n greedy tokens after prompt_ids from a transformers model, never stopping early."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, ids.shape[1] :].tolist()
