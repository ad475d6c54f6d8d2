"""Each decoder layer's MLP in tiles of tokens, with DeepSpeed's ``TiledMLP`` (ALST).

At long context the MLP is the largest transient of a layer: at 512K tokens and intermediate size 11008 each of its
``[N, 11008]`` bf16 activations is 11.5 GB, and the layer's forward, recompute and backward hold several at once.
``TiledMLP`` (``deepspeed.runtime.sequence_parallel.ulysses_sp``) runs the MLP a tile of tokens at a time without
keeping its activations and recomputes each tile in the backward, so only one tile's activations exist at a time;
it marks the MLP weights with ``ds_grad_is_ready`` so ZeRO reduces their gradients once, after the last tile.
Cost: one more MLP forward per step.
"""

from __future__ import annotations

import math
import types

import torch
from torch import nn

__all__ = ["enable_tiled_mlp"]


def _tiled_forward(tokens_per_tile: int):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        shards = max(1, math.ceil(x.shape[-2] * x.shape[:-2].numel() / tokens_per_tile))
        if shards == 1:
            return type(self).forward(self, x)
        return TiledMLP.apply(type(self).forward, self, x, shards, list(self.parameters()))

    return forward


def enable_tiled_mlp(model: nn.Module, tokens_per_tile: int) -> int:
    """Run every decoder layer's ``mlp`` (``model.model.layers[i].mlp``) in tiles of at most ``tokens_per_tile``
    tokens (``[B, n, hidden]`` in and out, any dtype); returns the number of MLPs switched.

    Raises:
        ValueError: ``tokens_per_tile < 1``, or the model has no ``model.layers[i].mlp`` (not a Llama-style decoder).
    """
    if not isinstance(tokens_per_tile, int) or tokens_per_tile < 1:
        raise ValueError(
            f"tokens_per_tile must be a whole number of tokens >= 1; got {tokens_per_tile!r} (the training job decides "
            '"auto" from its start-up memory estimate, ds_mtraining.memory.decide_auto)'
        )
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(hasattr(layer, "mlp") for layer in layers):
        raise ValueError(f"{type(model).__name__} has no model.layers[i].mlp to tile")
    forward = _tiled_forward(tokens_per_tile)
    for layer in layers:
        layer.mlp.forward = types.MethodType(forward, layer.mlp)
    return len(layers)
