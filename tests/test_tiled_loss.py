"""The tiled loss (integration/loss.py) against ``sequence_loss`` on full logits: values and gradients in fp64, no
logits tensor longer than a tile, the same loss and gradients from a tiny Qwen2, and inside a DeepSpeed ZeRO-2
engine with gradient accumulation (the training step's setting)."""

from __future__ import annotations

import math

import pytest
import torch
from distributed import run_distributed
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ds_mtraining.config import SparseAttentionConfig
from ds_mtraining.integration import loss as tiled
from ds_mtraining.integration.batch import IGNORE, Batch, make_batch, sequence_loss
from ds_mtraining.integration.loss import forward_loss, tiled_sequence_loss
from ds_mtraining.integration.model_loading import resolve_model
from ds_mtraining.integration.transformers import MTrainingAttention

VOCAB = 384  # differs from tiny-qwen2's hidden size (256), so only logits have it as their last dimension
TOL = {"rtol": 1e-12, "atol": 1e-15}
DENSE = SparseAttentionConfig(pattern="dense")


def _labels(b: int, n: int, vocab: int, seed: int, ignore: slice | None) -> torch.Tensor:
    labels = torch.randint(0, vocab, (b, n), generator=torch.Generator().manual_seed(seed))
    if ignore is not None:
        labels[:, ignore] = IGNORE
    return labels


def _grads(loss_fn, hidden: torch.Tensor, head: torch.nn.Linear) -> tuple[torch.Tensor, ...]:
    hidden = hidden.detach().requires_grad_()
    head.zero_grad()
    value = loss_fn(hidden)
    value.backward()
    return value.detach(), hidden.grad, head.weight.grad.clone()


@pytest.mark.parametrize(
    "b,n,shards,ignore",
    [
        pytest.param(1, 10, 3, None, id="uneven"),
        pytest.param(2, 9, 4, slice(2, 7), id="batch2-uneven-ignored"),
        pytest.param(2, 16, 4, slice(0, 8), id="fully-ignored-tiles"),
        pytest.param(1, 12, 1, slice(11, 12), id="one-tile"),
        pytest.param(1, 5, 8, None, id="more-shards-than-tokens"),
    ],
)
def test_matches_sequence_loss(b, n, shards, ignore):
    torch.manual_seed(0)
    head = torch.nn.Linear(24, 11, bias=False, dtype=torch.float64)
    hidden = torch.randn(b, n, 24, dtype=torch.float64)
    labels = _labels(b, n, 11, 1, ignore)
    label_tokens = int((labels != IGNORE).sum()) + 5  # other ranks' tokens count in the denominator too
    ref = _grads(lambda h: sequence_loss(head(h), labels, label_tokens), hidden, head)
    ours = _grads(lambda h: tiled_sequence_loss(h, head, labels, label_tokens, shards=shards), hidden, head)
    assert ours[0].dtype == torch.float64 and ours[0].shape == ()
    for got, want, what in zip(ours, ref, ("loss", "hidden grad", "weight grad")):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, what=what: f"{what}: {m}")


def test_fp32_loss_of_bf16_hidden():
    """bf16 hidden states and head (DeepSpeed bf16) give the fp32 loss of ``sequence_loss`` and bf16 gradients."""
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 50, bias=False, dtype=torch.bfloat16)
    hidden = torch.randn(2, 40, 32, dtype=torch.bfloat16)
    labels = _labels(2, 40, 50, 2, slice(0, 3))
    ref = _grads(lambda h: sequence_loss(head(h), labels, 77), hidden, head)
    ours = _grads(lambda h: tiled_sequence_loss(h, head, labels, 77, shards=3), hidden, head)
    assert ours[0].dtype == torch.float32
    assert ours[1].dtype == ours[2].dtype == torch.bfloat16
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-6, atol=0)
    assert torch.equal(ours[1], ref[1])  # a token's gradient is computed alike in any tile
    # The weight gradient sums over tiles (in fp32) instead of inside one bf16 matmul: bf16 rounding apart.
    assert float((ours[2].float() - ref[2].float()).abs().max() / ref[2].float().abs().max()) < 2**-7


def test_default_tiles_at_128k():
    """At 128K tokens x Qwen2's 151,936 ids: 75 tiles of 1,748 tokens, each under 1 GiB of fp32 logits."""
    rows = tiled._tile_rows(131072, 151936, None)
    assert rows == 1748 and math.ceil(131072 / rows) == 75
    assert rows * 151936 * 4 <= tiled.TILE_BYTES < math.ceil(131072 / 74) * 151936 * 4  # 74 tiles would not fit


def test_rejects_bad_inputs():
    head = torch.nn.Linear(8, 5, bias=False)
    with pytest.raises(ValueError, match="shards must be at least 1"):
        tiled_sequence_loss(torch.randn(1, 4, 8), head, torch.zeros(1, 4, dtype=torch.long), 4, shards=0)
    with pytest.raises(ValueError, match="disagree"):
        tiled_sequence_loss(torch.randn(1, 4, 8), head, torch.zeros(1, 3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="bias-free"):
        tiled_sequence_loss(torch.randn(1, 4, 8), torch.nn.Linear(8, 5), torch.zeros(1, 4, dtype=torch.long), 4)


def _model(tied: bool = True, dtype: torch.dtype = torch.float64):
    spec = resolve_model("tiny-qwen2", vocab_size=VOCAB, max_positions=512)
    spec.config.tie_word_embeddings = tied
    return spec.build(seed=0).to(dtype)


def _batch(b: int = 2, n: int = 150) -> Batch:
    tokens = torch.randint(0, VOCAB, (b, n), generator=torch.Generator().manual_seed(3))
    batch = make_batch(tokens, mesh=None, layout=None, pad_id=0)
    batch.labels[:, :20] = IGNORE  # e.g. a prompt
    return Batch(batch.input_ids, batch.labels, batch.position_ids, int((batch.labels != IGNORE).sum()))


def _reference_loss(model, batch: Batch, attention: MTrainingAttention) -> torch.Tensor:
    """What the training step computed before the tiled loss: the loss of the full logits."""
    logits = model(batch.input_ids, position_ids=batch.position_ids, use_cache=False, mtraining=attention).logits
    return sequence_loss(logits, batch.labels, batch.label_tokens)


def _model_grads(model, loss_fn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    value = loss_fn()
    value.backward()
    return value.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_forward_loss_matches_full_logits(tied):
    model, batch = _model(tied), _batch()
    ref_loss, ref = _model_grads(model, lambda: _reference_loss(model, batch, MTrainingAttention(DENSE)))
    loss, grads = _model_grads(model, lambda: forward_loss(model, batch, MTrainingAttention(DENSE), shards=7))
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert sorted(grads) == sorted(ref)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref[name], rtol=1e-12, atol=1e-14, msg=lambda m, name=name: f"{name}: {m}")


class _LongestLogits(TorchDispatchMode):
    """The most rows of any newly allocated ``[..., vocab]`` tensor made by an op (forward and backward).

    Views of an op's inputs (the head weight transposed, ``[hidden, vocab]``) are skipped: they allocate nothing."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            logits = isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab and t.numel()
            if logits and t.untyped_storage().data_ptr() not in inputs:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def _longest_logits(model, loss_fn) -> int:
    model.zero_grad()
    with _LongestLogits(VOCAB) as longest:
        loss_fn().backward()
    return longest.rows


def test_no_logits_longer_than_a_tile(monkeypatch):
    """Forward and backward of :func:`forward_loss` allocate logits of one tile at most (the default tiles, from a
    budget of 100 tokens' fp32 logits here); the full-logits path allocates all ``B * n`` rows."""
    model, batch = _model(dtype=torch.float32), _batch(b=2, n=200)
    monkeypatch.setattr(tiled, "TILE_BYTES", 100 * VOCAB * 4)
    assert _longest_logits(model, lambda: _reference_loss(model, batch, MTrainingAttention(DENSE))) == 400
    assert _longest_logits(model, lambda: forward_loss(model, batch, MTrainingAttention(DENSE))) == 100


def _engine_grads(tied: bool, zero: dict, loss_fn) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Two optimizer steps of accumulation 2 on a ZeRO-2 engine: the micro-batch losses and, at each boundary,
    the full gradient of every parameter."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from ds_mtraining.integration.recompute import enable_activation_checkpointing

    model = _model(tied, torch.float32)
    enable_activation_checkpointing(model)
    model.train()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": False} | zero,
        # Without offload, torch's AdamW: DeepSpeed's fused Adam is a CPU JIT build of 1.5 minutes no job test needs.
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": "offload_optimizer" not in zero}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    attention = MTrainingAttention(DENSE)
    losses, grads = [], []
    for micro in range(4):
        tokens = torch.randint(0, VOCAB, (1, 128), generator=torch.Generator().manual_seed(micro))
        loss = loss_fn(engine, make_batch(tokens, mesh=None, layout=None, pad_id=0), attention)
        engine.backward(loss)
        losses.append(float(loss))
        if micro % 2:
            grads.append({name: safe_get_full_grad(p).clone() for name, p in engine.module.named_parameters()})
        engine.step()
    return losses, grads


def _engine_worker(rank: int, world: int) -> None:
    import logging
    import os

    import deepspeed

    os.environ["LOCAL_RANK"] = str(rank)  # what a launcher sets; this process's group exists already
    deepspeed.utils.logger.setLevel(logging.ERROR)
    cases = [
        (True, {"offload_optimizer": {"device": "cpu"}}),  # ds_configs/zero2_offload.json's engine, tied head
        (False, {"reduce_bucket_size": 1000}),  # untied head; every gradient reduced the moment it arrives
    ]
    for tied, zero in cases:
        ref_losses, ref_grads = _engine_grads(tied, zero, _reference_loss)
        losses, grads = _engine_grads(tied, zero, lambda *a: forward_loss(*a, shards=5))
        assert losses == pytest.approx(ref_losses, rel=1e-6), (tied, zero)
        for step, (got, want) in enumerate(zip(grads, ref_grads)):
            for name, grad in got.items():
                error = float((grad - want[name]).abs().max() / want[name].abs().max())
                assert error < 1e-5, f"tied={tied} {zero} step {step} {name}: relative error {error:.2e}"


def test_deepspeed_zero2_accumulation():
    """In a ZeRO-2 engine with gradient accumulation 2 (CPU optimizer offload and a tied head; an untied head with
    tiny buckets), the gradients equal those of the full-logits loss. DeepSpeed's ``TiledFusedLogitsLoss`` and
    ``sequence_tiled_compute`` fail this (see the loss module's docstring)."""
    run_distributed(1, _engine_worker, timeout=240)
