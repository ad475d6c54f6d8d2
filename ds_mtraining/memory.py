"""Where the optimizer state goes: an estimate of a rank's GPU memory at the step's peak, checked at start-up.

CPU optimizer offload (``"offload_optimizer"``) keeps the fp32 master weights, Adam's two moments and the fp32
gradient partition on the host. It costs the CPU Adam step and the copies, during which the GPU idles: 1.2-1.4 s of
a step at 3.09B parameters on one H200, against 0.12 s for DeepSpeed's FusedAdam on the GPU
(docs/measurements.md, "Optimizer placement"). On a GPU large enough for the state that time is wasted; on
one too small, a config without offload runs out of memory mid-step, after minutes of start-up.
:func:`check_optimizer_placement` says which, before the process group exists.

The estimate (:func:`estimate_memory`) counts what the step holds at its peak, per rank:

- weights in the training dtype (ZeRO-3 partitions them);
- gradients in the training dtype, partitioned by ZeRO-2/3; with offload DeepSpeed copies each reduced bucket to the
  host, so the GPU holds two buckets (``reduce_bucket_size`` elements each, double-buffered by ``overlap_comm``);
- the optimizer state on the GPU (:data:`STATE_BYTES` a parameter), partitioned by ZeRO-1/2/3 over the
  data-parallel ranks; nothing with offload;
- activations: each checkpointed decoder layer's input (``N x hidden``; with ``cpu_checkpointing`` two on the GPU and
  all in pinned host memory, ``host_checkpoints``; a layer that does not checkpoint keeps a working set instead), the
  recomputed layer's working set in backward (``N x (h x hidden + i x intermediate)`` elements: q/k/v, attention
  output, the residual stream's copies, the MLP's gate, up and their product, their gradients, the loss's per-token
  buffers; ``(h, i)`` :data:`ACT_UNFUSED` or, with Liger's fused kernels, which keep less, :data:`ACT_FUSED`), and
  the loss's fixed buffers (ours: ``integration.loss.TILE_BYTES`` x 4; Liger's: the fp32 weight gradient,
  ``vocab x hidden x 4`` bytes). ``N`` is this rank's tokens (the sequence / sequence-parallel degree).

The factors are fitted to the peaks (``torch.cuda.max_memory_allocated``) the benchmark measured on one H200 at 128K
and 256K (docs/measurements.md; Qwen2.5-3B shape, yarn x16), within 4.5 % of each:
with offload, fused 38.8 against 40.2 at 128K and 68.9 against 71.5 at 256K, unfused 49.7 against 48.0 at 128K;
without offload, fused 83.0 against 82.4 at 128K and 113.0 against 111.5 at 256K, unfused 93.9 against 90.2 at
128K. The allocator's reserved memory runs above that peak (fragmentation): the one configuration estimated above
:data:`FILL` of the GPU, unfused without offload at 256K (132.0 of 139.8 GiB), ran out of memory in its first
micro-batch, while the highest measured one that ran, fused without offload at 256K, peaked at 112.7 (0.81).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MemoryEstimate", "check_optimizer_placement", "estimate_memory", "out_of_memory_message"]

GiB = 2**30
ACT_UNFUSED = (8, 6)
"""Elements per token of (the hidden size, the MLP's intermediate size) in one layer's backward working set with
transformers' modules (fitted; see the module docstring)."""
ACT_FUSED = (8, 3)
"""The same with Liger's fused RMSNorm, SwiGLU and RoPE (fitted)."""
STATE_BYTES = 14
"""GPU bytes a parameter for the optimizer without offload: fp32 master weights, Adam's m and v (12) and the fp32
gradient partition (4), less what ZeRO-2 frees; measured 41.9 GiB more at the peak than with offload at 3.09B
parameters (14.6 bytes a parameter)."""
OFFLOAD_SECONDS_PER_BILLION = 0.38
"""What CPU offload adds to the optimizer step per billion parameters of a rank's partition: (1.21-1.39) - 0.12 s at
3.09B on one H200 (its host's CPU Adam; another host's CPU differs)."""
FILL = 0.9
"""The share of the GPU a step's estimate may fill: above it a config without offload is refused, and a config with
offload gets no note that the state would fit (the allocator's fragmentation and other buffers; see above)."""
REDUCE_BUCKET = 500_000_000
"""DeepSpeed's default ``zero_optimization.reduce_bucket_size`` (elements)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """A rank's GPU memory at the step's peak, in bytes, by kind; ``optimizer`` is 0 when it lives on the host."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    offloadable: int
    """The optimizer state's bytes (on the host with offload, on the GPU without)."""
    offloaded_gradients: int = 0
    """The gradient bytes offload keeps on the host beyond the GPU's buckets (0 without offload)."""
    host_checkpoints: int = 0
    """The activation checkpoints' bytes in pinned host memory (``cpu_checkpointing``; 0 on the GPU)."""

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations

    def describe(self) -> str:
        return (
            f"weights {self.weights / GiB:.1f}, gradients {self.gradients / GiB:.1f}, optimizer state "
            f"{self.optimizer / GiB:.1f}, activations {self.activations / GiB:.1f} GiB"
        )


def count_parameters(model_config) -> int:
    """The parameter count of the causal LM of ``model_config`` (built on the meta device: no memory)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(model_config))
    return sum(p.numel() for p in model.parameters())


def estimate_memory(
    model_config,
    *,
    params: int,
    zero_stage: int,
    dp: int,
    offload: bool,
    tokens: int,
    fused: bool = False,
    dtype_bytes: int = 2,
    reduce_bucket: int = REDUCE_BUCKET,
    checkpoint_every: int | None = 1,
    checkpoints_on_host: bool = False,
) -> MemoryEstimate:
    """The estimate of the module docstring for one rank holding ``tokens`` tokens of each micro-batch.

    Args:
        model_config: the transformers config (``hidden_size``, ``intermediate_size``, ``num_hidden_layers``).
        params: the model's parameter count (:func:`count_parameters`).
        zero_stage: 0-3; dp: the data-parallel degree (ZeRO partitions over it).
        offload: the optimizer state lives on the host (``zero_optimization.offload_optimizer``).
        tokens: this rank's tokens of one micro-batch (micro-batch x sequence length / sequence-parallel degree).
        fused: Liger's fused kernels and loss are used (``integration.fused_kernels``).
        dtype_bytes: bytes of the training dtype (2 for bf16 / fp16, 4 for fp32).
        reduce_bucket: ``zero_optimization.reduce_bucket_size`` (elements; the gradients' GPU share with offload).
        checkpoint_every: every this-many-th decoder layer checkpoints (``activation_checkpointing.layers``; None:
            none); the others keep their working set from the forward to their backward.
        checkpoints_on_host: the checkpoints wait in pinned host memory (``cpu_checkpointing``): the GPU holds two
            (the layer in its backward and the one fetched ahead), the host all of them.

    The fit of the module docstring is of every layer checkpointed on the GPU; the other placements are the same
    terms moved (a kept layer priced at the recomputed layer's working set), not yet measured.
    """
    from .integration.loss import TILE_BYTES

    hidden, layers = model_config.hidden_size, model_config.num_hidden_layers
    intermediate, vocab = model_config.intermediate_size, model_config.vocab_size
    act_hidden, act_intermediate = ACT_FUSED if fused else ACT_UNFUSED
    weights = params * dtype_bytes // (dp if zero_stage >= 3 else 1)
    gradients = params * dtype_bytes // (dp if zero_stage >= 2 else 1)
    state = params * STATE_BYTES // (dp if zero_stage >= 1 else 1)
    checkpoint = tokens * hidden * dtype_bytes  # one layer's input
    checkpointed = 0 if checkpoint_every is None else -(-layers // checkpoint_every)
    on_gpu = min(2, checkpointed) if checkpoints_on_host else checkpointed
    working = tokens * (act_hidden * hidden + act_intermediate * intermediate) * dtype_bytes
    checkpoints = on_gpu * checkpoint + (layers - checkpointed) * working
    loss = vocab * hidden * 4 if fused else 4 * TILE_BYTES
    buckets = min(gradients, 2 * reduce_bucket * dtype_bytes) if offload else gradients
    return MemoryEstimate(
        weights=weights,
        gradients=buckets,
        optimizer=0 if offload else state,
        activations=checkpoints + working + loss,
        offloadable=state,
        offloaded_gradients=gradients - buckets,
        host_checkpoints=checkpointed * checkpoint if checkpoints_on_host else 0,
    )


def check_optimizer_placement(estimate: MemoryEstimate, *, offload: bool, device_bytes: int, source: str,
                              seqlen: int) -> str | None:  # fmt: skip
    """With offload: a note when the state would fit on the GPU (the estimate with it under :data:`FILL` of
    ``device_bytes``) and offloading it costs at least 0.05 s a step, naming that time; without: raise
    ``ConfigError`` when the estimate exceeds :data:`FILL` of the GPU. Returns the note or ``None``."""
    from .config import ConfigError

    if offload:
        on_gpu = estimate.total + estimate.offloadable + estimate.offloaded_gradients
        seconds = OFFLOAD_SECONDS_PER_BILLION * estimate.offloadable / STATE_BYTES / 1e9
        if on_gpu > FILL * device_bytes or seconds < 0.05:  # a small model: nothing worth a note to gain
            return None
        return (
            f"note: {source} offloads the optimizer state ({estimate.offloadable / GiB:.1f} GiB) to the CPU, but it "
            f"fits on this GPU (estimated peak {on_gpu / GiB:.0f} of {device_bytes / GiB:.0f} GiB at {seqlen} "
            f"tokens); without \"offload_optimizer\" (ds_configs/zero2.json) each optimizer step is about "
            f"{seconds:.1f} s shorter"
        )
    if estimate.total > FILL * device_bytes:
        raise ConfigError(
            f"{source}: keeps the optimizer state on the GPU, but a rank needs about {estimate.total / GiB:.0f} GiB at "
            f"{seqlen} tokens ({estimate.describe()}), more than the {FILL:.0%} of the GPU's {device_bytes / GiB:.0f} GiB "
            "that a step can fill; offload it "
            f'("offload_optimizer": {{"device": "cpu"}}, as in ds_configs/zero2_offload.json), or shorten --seqlen, '
            "or add GPUs"
        )
    return None


def out_of_memory_message(*, seqlen: int, offload: bool, fused: bool) -> str:
    """The one line for a step that ran out of GPU memory: how much this GPU has and held, and the fixes that apply
    (offload when the state is on the GPU, the fused kernels when they are off, a shorter or wider-spread sequence)."""
    import torch

    fixes = ['offload the optimizer state ("offload_optimizer": {"device": "cpu"}, as in ds_configs/zero2_offload.json)'] * (
        not offload
    ) + ['turn the fused kernels on ("fused_kernels": {"enabled": true})'] * (not fused) + [
        'shorten --seqlen, or spread each sequence over more GPUs ("parallel": {"sequence_parallel_size"})'
    ]
    held = ""
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        held = f" ({torch.cuda.max_memory_allocated() / GiB:.0f} of this GPU's {total / GiB:.0f} GiB allocated)"
    return f"out of GPU memory in a step of {seqlen} tokens a sequence{held}: " + "; or ".join(fixes)
