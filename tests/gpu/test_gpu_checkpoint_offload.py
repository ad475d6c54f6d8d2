"""Activation checkpoints in CPU memory on a GPU (``integration.checkpoint_offload``): the side-stream copies give the
gradients of checkpoints kept on the GPU bit for bit, and the forward ends with the checkpoints off the GPU.

The CPU tests run the same hooks without streams (``tests/test_checkpoint_offload.py``); this is where the copies'
stream order (a copy after the forward wrote its input, the compute waiting for a fetched one) is checked.
"""

from __future__ import annotations

import gc

import pytest
import torch

from ds_mtraining.config import SparseAttentionConfig, SpreadEstimator
from ds_mtraining.integration.checkpoint_offload import CheckpointOffload
from ds_mtraining.integration.model_loading import resolve_model
from ds_mtraining.integration.recompute import enable_activation_checkpointing
from ds_mtraining.integration.transformers import MTrainingAttention

cuda = pytest.mark.cuda
VOCAB, B, N = 128, 2, 4096
SPARSE = SparseAttentionConfig(
    block_size=64,
    estimator=SpreadEstimator(rows=32, max_columns=64, max_offsets=8, recall=0.8),
    overrides=[],  # every layer on the deterministic sparse kernels: the two runs can agree bit for bit
)


@cuda
def test_offloaded_checkpoints_on_a_gpu_give_the_same_gradients_and_leave_the_gpu():
    model = resolve_model("tiny-qwen2", vocab_size=VOCAB, max_positions=N).build(seed=0).cuda().to(torch.bfloat16)
    model.train()
    ids = torch.randint(0, VOCAB, (B, N), generator=torch.Generator().manual_seed(0)).cuda()
    layers = model.config.num_hidden_layers
    checkpoint_bytes = layers * B * N * model.config.hidden_size * 2
    results = {}
    for name, offload in (("gpu", None), ("cpu", CheckpointOffload("cuda"))):
        for step in range(2):  # the second step takes its host buffers from the pool
            enable_activation_checkpointing(model, offload=offload)
            model.zero_grad()
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            logits = model(ids, mtraining=MTrainingAttention(SPARSE)).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            torch.cuda.synchronize()
            torch.empty(1, device="cuda")  # the allocator frees blocks a side stream used at its next allocation
            held = torch.cuda.memory_allocated() - before
            loss.backward()
            torch.cuda.synchronize()
            results[name, step] = (held, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    for step in range(2):
        gpu, cpu = results["gpu", step], results["cpu", step]
        assert torch.equal(cpu[1], gpu[1])
        assert all(torch.equal(cpu[2][n], g) for n, g in gpu[2].items())
        # The checkpoints (each layer's bf16 input) are what the offload takes off the GPU after the forward.
        assert gpu[0] - cpu[0] >= 0.9 * checkpoint_bytes, (gpu[0], cpu[0], checkpoint_bytes)


@cuda
def test_pinned_host_memory_is_what_the_memory_plan_counts():
    """PyTorch's pinned-memory allocator rounds every block up to a power of two (``memory.pinned_bytes``): the
    offload pins a checkpoint that is not a power of two in pieces that are (``memory.pinned_pieces``), so its host
    pool takes what the checkpoints hold, as the plan's host estimate counts, not the rounded size."""
    from ds_mtraining.memory import pinned_bytes, pinned_pieces

    n = 3 * 1024  # a checkpoint of B x 3K x hidden x 2 bytes: 1.5 times a power of two
    model = resolve_model("tiny-qwen2", vocab_size=VOCAB, max_positions=n).build(seed=0).cuda().to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (B, n), generator=torch.Generator().manual_seed(0)).cuda()
    offload = CheckpointOffload("cuda")
    enable_activation_checkpointing(model, offload=offload)
    # The pinned-memory statistics are the process's: an earlier test's pool, held in reference cycles (the hooks),
    # would be freed by a collection during this step and read as a negative growth (seen on an H100: -4 MiB - 1).
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.host_memory_stats()["allocated_bytes.current"]
    model(ids, mtraining=MTrainingAttention(SPARSE)).logits.float().sum().backward()
    torch.cuda.synchronize()
    pinned = torch.cuda.host_memory_stats()["allocated_bytes.current"] - before
    elements = B * n * model.config.hidden_size
    assert len(pinned_pieces(elements)) == 2 and pinned_bytes(2 * elements) == 4 / 3 * 2 * elements
    assert pinned == model.config.num_hidden_layers * 2 * elements == offload.host_bytes()
