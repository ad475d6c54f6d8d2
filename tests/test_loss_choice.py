"""Which training loss: the project's tiled loss (``integration/loss.py``) or Liger Kernel's fused linear
cross-entropy (``liger_kernel.ops.fused_linear_cross_entropy``), each in the DeepSpeed engines training builds.

Each replaces the head-and-loss step of :func:`~ds_mtraining.integration.loss.forward_loss` (the model call, the
final hidden states and ``sum_sequence_parallel_gradients`` stay the production code's), and so does
``sequence_loss`` on the full fp32 logits, the same-precision baseline. Every engine trains a tiny fp32 Qwen2 for one
accumulation boundary; its loss and EVERY parameter's full gradient are compared with a float64 single-process
reference (full logits, whole sequences), and each candidate's error must stay within a small multiple of the
baseline's (the fp32 rounding of the rest of the model, which all three share): a wrong scale or a missing
contribution is off by far more.

Liger runs on CPU: its Triton kernels (the cross-entropy row kernel and ``element_mul_kernel``) go through the
Triton interpreter (``conftest.py``) and need no ``tl.dot``; its matrix products are torch's.

Wiring Liger into the engine (``integration.loss.liger_sequence_loss``, which training uses on the GPU):

- ``reduction="sum"`` divided by the whole sequence's label tokens: Liger's ``"mean"`` divides by this rank's own
  label count, which under sequence parallelism is not the sequence's token mean (the ranks' counts differ by the
  padding); its HF integration (``LigerForCausalLMLoss``) also shifts labels itself unless given ``shift_labels``,
  while ``make_batch`` has shifted them on the whole sequence already.
- ``accum_dtype=torch.float32``: the weight gradient is summed over chunks in fp32 as ours is (the default sums a
  bf16 weight's chunks in bf16).
- It computes both gradients during the forward and only scales them by the incoming gradient in the backward, so
  under ZeRO-3 the head weight is gathered in the forward (``_full_weight``) and again in the backward until autograd
  has accumulated its full-shape gradient (:class:`_GatherUntilAccumulated`), as ``tiled_sequence_loss`` does.
  Without the second gather an untied head fails in the first backward ("The size of tensor a (0) must match ...");
  a tied one passes, since the embedding's own backward gathers the shared weight before the accumulation.
"""

from __future__ import annotations

from unittest import mock

import torch
from distributed import run_distributed
from test_train_parallel import tiny_qwen2

from ds_mtraining.integration import loss as loss_module
from ds_mtraining.integration.batch import IGNORE, make_batch, sequence_loss
from ds_mtraining.integration.loss import forward_loss, liger_sequence_loss, tiled_sequence_loss

VOCAB = 96  # not the model's hidden size (64): a transposed weight or gradient cannot pass unnoticed
N = 100  # tokens per sequence; ring 2 pads it to 128 (two 64-token stripes), so the ranks' label counts differ
PROMPT = 20  # labels of the first tokens ignored (a prompt) where there is no padding to ignore
SHARDS = 5  # our loss's tiles; Liger chunks 100 tokens into 2 (64 + 36), a ring rank's 64 into 2 x 32
ACCUMULATION = 2
ERROR_FACTOR = 4.0
"""A candidate's error (largest entry of ``|x - x_float64|`` per gradient, and the loss's) may be this many times
the full-logits baseline's error plus ``ERROR_FLOOR``: measured, Liger's gradients at most 1.53x the baseline's,
ours 1.0x (a token's gradient is computed alike in any tile); the losses within 3e-7 of float64 (1.8e-8 for
the baseline on the ring)."""
ERROR_FLOOR = torch.finfo(torch.float32).eps
"""One fp32 rounding of the reference's largest entry (of the loss or of the gradient), for where the baseline's
error happens to be near 0."""


def full_logits_loss(
    hidden: torch.Tensor, lm_head: torch.nn.Linear, labels: torch.Tensor, label_tokens: int, *, shards=None
) -> torch.Tensor:
    """The baseline: ``sequence_loss`` on ``[B, n, vocab]`` logits (the ``lm_head`` module gathers itself)."""
    return sequence_loss(lm_head(hidden), labels, label_tokens)


def _loss(name: str, model, batch, attention) -> torch.Tensor:
    """``forward_loss`` with the head loss ``name``: ours, Liger's, or the full-logits baseline."""
    if name == "full":
        with mock.patch.object(loss_module, "tiled_sequence_loss", full_logits_loss):
            return forward_loss(model, batch, attention)
    return forward_loss(model, batch, attention, fused=name == "liger", shards=SHARDS)


def _model(tied: bool, dtype: torch.dtype):
    # initialised in fp32 and then cast: an fp64 initialisation draws other weights
    return tiny_qwen2(tied=tied, vocab=VOCAB).to(dtype)


def _batch(micro: int, prompt: bool, mesh=None, layout=None):
    """Micro-batch ``micro`` on this rank; with ``prompt`` its first ``PROMPT`` labels are ignored (on a whole
    sequence only: a ring rank's labels are cut from the padded one, whose padding is ignored already)."""
    from dataclasses import replace

    tokens = torch.randint(0, VOCAB, (1, N), generator=torch.Generator().manual_seed(micro))
    batch = make_batch(tokens, mesh=mesh, layout=layout, pad_id=0)
    if not prompt:
        return batch
    labels = batch.labels.clone()
    labels[:, :PROMPT] = IGNORE
    return replace(batch, labels=labels, label_tokens=int((labels != IGNORE).sum()))


def _reference(tied: bool, prompt: bool, attention):
    """float64, one process, whole sequences, full logits: the loss (mean over micro-batches) and gradients."""
    model = _model(tied, torch.float64)
    total = 0.0
    for micro in range(ACCUMULATION):
        loss = _loss("full", model, _batch(micro, prompt), attention) / ACCUMULATION
        loss.backward()
        total += float(loss.detach())
    return total, {name: p.grad for name, p in model.named_parameters()}


def _engine_run(name: str, stage: int, tied: bool, mesh, layout, attention) -> tuple[float, dict]:
    """One accumulation boundary of a fresh fp32 engine with head loss ``name``: the loss (summed over the
    sequence-parallel ranks, mean over micro-batches) and every parameter's full gradient at the boundary.

    Fresh: ZeRO-3 records the modules' order in the first step and prefetches parameters from the second on, which
    can gather the head weight for a loss that does not gather it itself (measured: Liger without
    :class:`_GatherUntilAccumulated` and an untied head fails in a fresh engine's first backward, and passed in an
    engine that had run two boundaries before)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad
    from test_zero_stages import _ds_config

    from ds_mtraining.integration.recompute import enable_activation_checkpointing
    from ds_mtraining.integration.deepspeed import MeshMPU, sum_sequence_parallel_gradients

    model = _model(tied, torch.float32)
    enable_activation_checkpointing(model)
    model.train()
    mpu = None if mesh is None else MeshMPU(mesh)
    config = _ds_config(stage, ACCUMULATION)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    sum_sequence_parallel_gradients(engine)
    total = torch.zeros((), dtype=torch.float64)
    for micro in range(ACCUMULATION):
        loss = _loss(name, engine, _batch(micro, mesh is None, mesh, layout), attention)
        engine.backward(loss)
        total += float(loss.detach()) / ACCUMULATION
        if micro == ACCUMULATION - 1:  # at the boundary, before the step
            grads = {n: safe_get_full_grad(p).double().cpu() for n, p in engine.module.named_parameters()}
        engine.step()
    engine.destroy()
    dist.all_reduce(total)
    return float(total), grads


def _check(runs: dict, ref_loss: float, ref_grads: dict, where: str) -> None:
    """Each candidate's loss and gradients against float64 within ``ERROR_FACTOR`` x the full-logits baseline's."""
    base_loss, base_grads = runs.pop("full")
    for name, (loss, grads) in runs.items():
        bound = ERROR_FACTOR * (abs(base_loss - ref_loss) + ERROR_FLOOR * abs(ref_loss))
        assert abs(loss - ref_loss) <= bound, f"{name} loss {loss} vs float64 {ref_loss} (full {base_loss}): {where}"
        assert sorted(grads) == sorted(ref_grads), where
        for param, ref in ref_grads.items():
            error, base = (float((g[param] - ref).abs().max()) for g in (grads, base_grads))
            bound = ERROR_FACTOR * (base + ERROR_FLOOR * float(ref.abs().max()))
            assert error <= bound, (
                f"{name} gradient of {param}: max error {error:.3g} > {bound:.3g} "
                f"(full-logits fp32 baseline {base:.3g}, largest entry {float(ref.abs().max()):.3g}): {where}"
            )


def _worker(rank: int, world: int, cases: list[tuple[int, bool]]) -> None:
    """``cases``: (ZeRO stage, tied) engines, one after the other. ``world`` ranks are one ring of sequence
    parallelism (striped layout, 64-token blocks); 1 rank: no mesh, a prompt of ignored labels instead."""
    import logging
    import os

    import deepspeed
    from test_train_parallel import sequence_parallel_config

    from ds_mtraining.integration.transformers import MTrainingAttention
    from ds_mtraining.parallel.mesh import Mesh, MeshShape

    os.environ["LOCAL_RANK"] = str(rank)  # what a launcher sets; this process's group exists already
    deepspeed.utils.logger.setLevel(logging.ERROR)
    config = sequence_parallel_config(1, world, None, sparse=False)
    mesh = layout = None
    if world > 1:
        shape = MeshShape.build(world=world, ulysses=1, ring=world, q_heads=4, kv_heads=2)
        mesh, layout = Mesh(shape), shape.layout(N, kind="striped", block_size=64, stripe=None)
    attention = MTrainingAttention(config.sparse_attention, mesh=mesh, layout=layout)
    for stage, tied in cases:
        reference = _reference(tied, world == 1, MTrainingAttention(config.sparse_attention))
        runs = {name: _engine_run(name, stage, tied, mesh, layout, attention) for name in ("full", "tiled", "liger")}
        _check(runs, *reference, f"rank {rank}, ZeRO-{stage}, ring {world}, tied={tied}, accumulation {ACCUMULATION}")


def test_single_process_engines():
    """One process: ZeRO-2 with a tied and an untied head, ZeRO-3 (partitioned head) untied; accumulation 2. One
    process runs all three: starting one costs about as much as an engine's runs.

    ZeRO-3 untied is the case where the head weight must be gathered for the accumulation of its gradient: a tied
    one is gathered by the embedding's own backward before autograd accumulates the summed gradient."""
    run_distributed(1, _worker, [(2, True), (2, False), (3, False)], timeout=120)


def test_ring2_zero3_engine():
    """Two gloo processes, one ring of 2 (sequence parallelism; the ranks hold 64 and 35 label tokens): ZeRO-3,
    tied head, accumulation 2."""
    run_distributed(2, _worker, [(3, True)], timeout=120)
