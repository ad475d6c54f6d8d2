"""``enable_tiled_mlp``: the tiled MLP gives the plain model's loss and every parameter's gradient (fp64), with and
without activation checkpointing, and no MLP activation longer than a tile exists."""

from __future__ import annotations

import pytest
import torch

from ds_mtraining.config import SparseAttentionConfig, SpreadEstimator
from ds_mtraining.integration.model_loading import resolve_model
from ds_mtraining.integration.recompute import enable_activation_checkpointing
from ds_mtraining.integration.tiled_mlp import enable_tiled_mlp
from ds_mtraining.integration.transformers import MTrainingAttention

VOCAB, N = 128, 300  # 300 tokens: tiles of 64 leave a short last one


def _loss_and_grads(tile: int | None, checkpointing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = resolve_model("tiny-qwen2", vocab_size=VOCAB, max_positions=1024).build(seed=0).double()
    if tile is not None:
        assert enable_tiled_mlp(model, tile) == 4
    if checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    ids = torch.randint(0, VOCAB, (2, N), generator=torch.Generator().manual_seed(1))
    attention = MTrainingAttention(SparseAttentionConfig(block_size=64, estimator=SpreadEstimator(rows=16, recall=0.9)))
    logits = model(ids, mtraining=attention, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_tiled_mlp_matches_the_plain_mlp(checkpointing):
    loss, grads = _loss_and_grads(None, checkpointing)
    tiled_loss, tiled_grads = _loss_and_grads(64, checkpointing)
    torch.testing.assert_close(tiled_loss, loss, rtol=1e-12, atol=0)
    assert grads.keys() == tiled_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(tiled_grads[name], grad, rtol=1e-10, atol=1e-13, msg=name)


def test_no_mlp_activation_longer_than_a_tile():
    """The MLP's up projection never sees more than a tile of tokens (it would see 2 x 300 untiled)."""
    model = resolve_model("tiny-qwen2", vocab_size=VOCAB, max_positions=1024).build(seed=0)
    enable_tiled_mlp(model, 64)
    seen = []
    hook = model.model.layers[1].mlp.up_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape[:-1].numel()))
    ids = torch.randint(0, VOCAB, (2, N), generator=torch.Generator().manual_seed(2))
    out = model(ids, mtraining=MTrainingAttention(SparseAttentionConfig(pattern="dense")), use_cache=False).logits
    out.sum().backward()
    hook.remove()
    assert seen and max(seen) <= 64 and sum(seen) == 2 * (2 * N)  # forward tiles, then the backward's recompute


def test_bad_arguments():
    model = resolve_model("tiny-qwen2", vocab_size=VOCAB, max_positions=1024).build(seed=0)
    with pytest.raises(ValueError, match="whole number of tokens >= 1; got 0"):
        enable_tiled_mlp(model, 0)
    with pytest.raises(ValueError, match="has no model.layers"):
        enable_tiled_mlp(torch.nn.Linear(2, 2), 64)
