"""Greedy generation with a sparse (or dense) prefill and dense decoding over the KV cache."""

from __future__ import annotations

import inspect

import torch

from ds_mtraining.integration.transformers import MTrainingAttention

__all__ = ["greedy_generate"]


@torch.no_grad()
def greedy_generate(
    model, input_ids: torch.Tensor, attention: MTrainingAttention, max_new_tokens: int, stop_ids: set[int] = frozenset()
) -> list[int]:
    """Token ids generated after ``input_ids`` ``[1, N]`` (greedy, up to ``max_new_tokens``, stopping at ``stop_ids``).

    The prompt is prefilled in one forward through ``attention`` (sparse if it says so); every new token then
    attends densely to the cache.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)  # updated in place by every forward below
    # transformers 5.24 renamed the forward's past_key_values to cache (the old name warns until its removal).
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids, use_cache=True, mtraining=attention, logits_to_keep=1, **{name: cache})
    generated: list[int] = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        if token in stop_ids:
            break
        generated.append(token)
        step = torch.tensor([[token]], device=input_ids.device)
        out = model(step, use_cache=True, mtraining=attention, **{name: cache})
    return generated
