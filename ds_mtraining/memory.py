"""A rank's memory at the step's peak, estimated at start-up: the job runs, or refuses in one line naming the settings
that would make it fit.

CPU optimizer offload (``"offload_optimizer"``) keeps the fp32 master weights, Adam's two moments and the fp32
gradient partition on the host. It costs the CPU Adam step and the copies, during which the GPU idles: 1.2-1.4 s of
a step at 3.09B parameters on one H200, against 0.12 s for DeepSpeed's FusedAdam on the GPU
(docs/measurements.md, "Optimizer placement"). On a GPU large enough for the state that time is wasted; on
one too small, a config without offload runs out of memory mid-step, after minutes of start-up. The checkpoints
(every decoder layer's input) are most of a long sequence's memory; they can wait in pinned host memory
(``cpu_checkpointing``), the MLP can run in tiles (``tiled_mlp``), and ``keep_attention`` trades memory for the
recomputation's attention. :func:`check_memory` weighs them, before the process group exists: a note where the
offload is not needed, a refusal naming each setting of :data:`LEVERS` that makes a config fit (host memory
included) where it does not. :func:`plan_memory` is that start-up plan whole, the one function both routes call (the
job's ``training.plan`` and the Trainer route's ``integration.hf_trainer.plan_trainer``): the config's ``"auto"``
levers decided (:func:`decide_auto`), then the check.

The estimate (:func:`estimate_memory`) counts what the step holds at its peak, per rank:

- weights in the training dtype (ZeRO-3 partitions them);
- gradients in the training dtype, partitioned by ZeRO-2/3; with offload DeepSpeed copies each reduced bucket to the
  host, so the GPU holds two buckets (``reduce_bucket_size`` elements each, double-buffered by ``overlap_comm``);
- the optimizer state on the GPU (:data:`STATE_BYTES` a parameter), partitioned by ZeRO-1/2/3 over the
  data-parallel ranks; nothing with offload, which holds it on the host instead (:func:`offload_host_bytes`: what
  DeepSpeed allocates there, its pinned buffers at the sizes PyTorch's pinned-memory allocator gives them);
- activations: each checkpointed decoder layer's input (``N x hidden``; with ``cpu_checkpointing``
  :data:`HOST_CHECKPOINTS_ON_GPU` of them on the GPU and all in pinned host memory, ``host_checkpoints``; a layer that
  does not checkpoint keeps a working set instead), the recomputed layer's working set in backward (``N x (h x hidden
  + i x intermediate)`` elements: q/k/v, attention output, the residual stream's copies, the MLP's gate, up and their
  product, their gradients, the loss's per-token buffers; ``(h, i)`` :data:`ACT_UNFUSED` or, with Liger's fused
  kernels, which keep less, :data:`ACT_FUSED`), and the loss's fixed buffers (ours: ``integration.loss.TILE_BYTES`` x
  4; Liger's: the fp32 weight gradient, ``vocab x hidden x 4`` bytes). ``N`` is this rank's tokens (the sequence /
  sequence-parallel degree).

The factors are fitted to the peaks (``torch.cuda.max_memory_allocated``) the benchmark measured on one H200 at 128K
and 256K (docs/measurements.md; Qwen2.5-3B shape, yarn x16), within 4.5 % of each:
with offload, fused 38.8 against 40.2 at 128K and 68.9 against 71.5 at 256K, unfused 49.7 against 48.0 at 128K;
without offload, fused 83.0 against 82.4 at 128K and 113.0 against 111.5 at 256K, unfused 93.9 against 90.2 at
128K. The allocator's reserved memory runs above that peak (fragmentation): the configurations estimated above
:data:`FILL` of the GPU ran out of memory in their first micro-batch, unfused without offload at 256K on an H200
(132.0 of 139.8 GiB, 0.94) and ``zero2_offload.json`` at 256K on an 80 GB H100 (68.9 of 79.6 GiB, 0.87), while the
highest one that ran, fused without offload at 256K on the H200, was estimated at 0.81 (peak 112.7 GiB).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .models import head_dim

if TYPE_CHECKING:
    from .config import MTrainingConfig
    from .parallel.mesh import MeshShape

__all__ = [
    "LEVERS", "Machine", "MemoryEstimate", "auto_off", "check_memory", "decide_auto", "estimate_memory",
    "offload_host_bytes", "out_of_memory_message", "pinned_bytes", "pinned_pieces", "plan_memory", "step_estimate",
    "this_machine",
]  # fmt: skip

GiB = 2**30
ACT_UNFUSED = (8, 6)
"""Elements per token of (the hidden size, the MLP's intermediate size) in one layer's backward working set with
transformers' modules (fitted; see the module docstring)."""
ACT_FUSED = (8, 3)
"""The same with Liger's fused RMSNorm, SwiGLU and RoPE (fitted)."""
TILED_MLP_HIDDEN = 7.5
"""Hidden-size elements per token more that a tiled MLP's layer holds (the whole rows' input, output and their
gradients around the tiles): fitted to the one tiled peak measured, 119.0 GiB at 512K with tiles of 32768 tokens,
unfused, with offload, on an H200 (``benchmarks/results/2026-12-01-h200-train_throughput.md``, C), where one tile's
share alone gives 103.6."""
STATE_BYTES = 14
"""GPU bytes a parameter for the optimizer without offload: fp32 master weights, Adam's m and v (12) and the fp32
gradient partition (4), less what ZeRO-2 frees; measured 41.9 GiB more at the peak than with offload at 3.09B
parameters (14.6 bytes a parameter)."""
OFFLOAD_SECONDS_PER_BILLION = 0.38
"""What CPU offload adds to the optimizer step per billion parameters of a rank's partition: (1.21-1.39) - 0.12 s at
3.09B on one H200 (its host's CPU Adam; another host's CPU differs)."""
HOST_CHECKPOINTS_ON_GPU = 6
"""Checkpoint-sized tensors the GPU holds at the peak with the checkpoints in host memory: fitted to the peaks of
``cpu_checkpointing`` on one H100 (``zero2_offload.json``, fused, sparse; 24.0 GiB at 128K and 39.0 at 256K measured,
23.8 and 38.9 estimated; ``benchmarks/results/2026-12-07-h100-checkpoint_offload_memory.md``). Two are the layer in
its backward and the one fetched ahead; the others come and go around them (the copies in flight, the final norm's
output and gradient at the loss), which the working-set fit, made with every checkpoint on the GPU, does not see."""
FILL = 0.85
"""The share of the GPU a step's estimate may fill: above it a config is refused, and a config with offload gets no
note that the state would fit (the allocator's fragmentation and other buffers: between the 0.81 that ran and the
0.87 that did not, module docstring)."""
REDUCE_BUCKET = 500_000_000
"""DeepSpeed's default ``zero_optimization.reduce_bucket_size`` (elements)."""
SUB_GROUP = 1_000_000_000
"""DeepSpeed's default ``zero_optimization.sub_group_size`` (elements): ZeRO-3 pins its offloaded fp32 gradients in
buffers of this many."""


def pinned_bytes(nbytes: int) -> int:
    """Host bytes a pinned tensor of ``nbytes`` takes: PyTorch's caching host allocator (``pin_memory``, which
    DeepSpeed uses) rounds every block up to a power of two, to reuse blocks by size. A 3.09B model's fp32 master
    weights, 11.5 GiB, take 16."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def pinned_pieces(numel: int) -> list[int]:
    """Element counts, powers of two and largest first, of the pieces that hold ``numel`` elements in pinned memory
    without :func:`pinned_bytes`' rounding: the binary digits of ``numel`` rounded up to a 64th of its largest power
    of two (at most 7 pieces, under 1/64 more than ``numel``). The offloaded checkpoints are pinned so
    (:mod:`.integration.checkpoint_offload`): 1.25M tokens of a 2048-wide model are 5 GiB a layer, 8 in one block."""
    if numel <= 0:
        return []
    granule = max(1, 1 << (numel.bit_length() - 1) >> 6)
    total = -(-numel // granule) * granule
    return [1 << bit for bit in range(total.bit_length() - 1, -1, -1) if total >> bit & 1]


def offload_host_bytes(
    partition: int, *, zero_stage: int, dtype_bytes: int, largest: int, pinned: bool, sub_group: int = SUB_GROUP
) -> int:
    """Host bytes DeepSpeed's CPU optimizer offload (``offload_optimizer``, ZeRO-1/2/3) holds for a rank's
    ``partition`` parameters, as DeepSpeed 0.19 allocates them (read in ``runtime/zero/stage_1_and_2.py`` and
    ``stage3.py``; a CPU test lists the engine's host tensors against it): fp32 master weights and their fp32
    gradients (4 + 4 bytes a parameter), a buffer in the training dtype (``dtype_bytes``; ZeRO-1/2 the weights copied
    back, ZeRO-3 the reduced gradients) and Adam's two fp32 moments (8); ZeRO-1/2 also a gradient buffer of the
    ``largest`` parameter's size (a decoder's embedding or MLP matrix). With ``pinned``
    (``offload_optimizer.pin_memory``) each buffer DeepSpeed pins takes :func:`pinned_bytes`: all of them but the
    moments and ZeRO-3's master weights, ZeRO-3 pinning its fp32 gradients in buffers of ``sub_group`` parameters
    (``sub_group_size``). One parameter group, as both routes build it from a config with an ``"optimizer"`` section
    (transformers' DeepSpeed integration then passes the parameters as one list); with several, each group's pinned
    buffers round up apart."""
    pin = pinned_bytes if pinned else (lambda n: n)
    moments = 8 * partition
    if zero_stage >= 3:
        groups = [sub_group] * (partition // sub_group) + [partition % sub_group] * bool(partition % sub_group)
        return moments + 4 * partition + pin(dtype_bytes * partition) + sum(pin(4 * g) for g in groups)
    return moments + 2 * pin(4 * partition) + pin(dtype_bytes * partition) + pin(dtype_bytes * largest)


@dataclass(frozen=True)
class MemoryEstimate:
    """A rank's GPU memory at the step's peak, in bytes, by kind; ``optimizer`` is 0 when it lives on the host."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    offloadable: int
    """The optimizer state's bytes on the GPU without offload (what offloading it frees there; on the host it takes
    ``host_state``)."""
    offloaded_gradients: int = 0
    """The gradient bytes offload keeps off the GPU beyond its buckets (0 without offload)."""
    host_checkpoints: int = 0
    """The activation checkpoints' bytes in pinned host memory (``cpu_checkpointing``; 0 on the GPU)."""
    host_state: int = 0
    """The optimizer's bytes on the host with offload (:func:`offload_host_bytes`; 0 without offload)."""

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
    mlp_tile: int | None = None,
    kept_attention_layers: int = 0,
    pinned_offload: bool = True,
    sub_group: int = SUB_GROUP,
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
        checkpoints_on_host: the checkpoints wait in pinned host memory (``cpu_checkpointing``): the GPU holds
            :data:`HOST_CHECKPOINTS_ON_GPU` of their size, the host all of them.
        mlp_tile: the MLP runs in tiles of this many tokens (``tiled_mlp.tokens_per_tile``): its per-token share of
            the working set is held for one tile at a time.
        kept_attention_layers: sparse layers that keep their attention output and lse until their backward
            (``keep_attention``): ``tokens x heads x (head_dim x dtype_bytes + 4)`` bytes each.
        pinned_offload: the offloaded state is pinned (``offload_optimizer.pin_memory``, as the shipped config has
            it); sub_group: ``zero_optimization.sub_group_size`` (:func:`offload_host_bytes`).

    The fit of the module docstring is of every layer checkpointed on the GPU, the MLP whole and no kept attention;
    the other levers move its terms (a layer that does not checkpoint priced at the recomputed layer's working set, a
    tiled MLP's share at one tile plus :data:`TILED_MLP_HIDDEN`). Measured: the kept attention, 17.8 GiB estimated for
    the 3B shape's 35 sparse layers at 128K against 17.2 (one H200, ``benchmarks/results/2026-12-01-h200-
    train_throughput.md``, configuration B), and the tiled MLP at 512K, fitted to its one peak; the checkpoints on
    the host fitted to two peaks on one H100 (:data:`HOST_CHECKPOINTS_ON_GPU`).
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
    on_gpu = min(HOST_CHECKPOINTS_ON_GPU, checkpointed) if checkpoints_on_host else checkpointed
    mlp_tokens = tokens
    if mlp_tile is not None:
        mlp_tokens, act_hidden = min(tokens, mlp_tile), act_hidden + TILED_MLP_HIDDEN
    working = int((tokens * act_hidden * hidden + mlp_tokens * act_intermediate * intermediate) * dtype_bytes)
    checkpoints = on_gpu * checkpoint + (layers - checkpointed) * working
    kept = 0
    if kept_attention_layers:
        heads = model_config.num_attention_heads
        kept = kept_attention_layers * tokens * heads * (head_dim(model_config) * dtype_bytes + 4)
    loss = vocab * hidden * 4 if fused else 4 * TILE_BYTES
    buckets = min(gradients, 2 * reduce_bucket * dtype_bytes) if offload else gradients
    return MemoryEstimate(
        weights=weights,
        gradients=buckets,
        optimizer=0 if offload else state,
        activations=checkpoints + working + loss + kept,
        offloadable=state,
        offloaded_gradients=gradients - buckets,
        host_checkpoints=checkpointed * sum(pinned_pieces(tokens * hidden)) * dtype_bytes if checkpoints_on_host else 0,
        host_state=offload_host_bytes(
            params // (dp if zero_stage >= 1 else 1), zero_stage=zero_stage, dtype_bytes=dtype_bytes,
            largest=max(vocab, intermediate, hidden) * hidden, pinned=pinned_offload, sub_group=sub_group,
        ) if offload else 0,
    )  # fmt: skip


MLP_TILE = 32768
"""The MLP tile a refusal proposes (``tiled_mlp.tokens_per_tile``): the one measured at 512K on an H200."""
HOST_FILL = 0.85
"""The share of a node's RAM its ranks' pinned checkpoints and offloaded optimizer state may take (the process's own
memory beside them). On one H100 machine of 128 GiB, ``zero2_offload.json`` with ``cpu_checkpointing`` at 256K
(estimated 100 GiB: 36 of checkpoints, 64 of optimizer state) trained, and the same with the 18 GiB of a 128K run's
checkpoints still pinned in its process (118 GiB) was killed for memory
(``benchmarks/results/2026-12-07-h100-checkpoint_offload_memory.md``)."""
LEVERS: dict[str, dict[Any, str]] = {
    "offload": {
        True: '"zero_optimization": {"offload_optimizer": {"device": "cpu"}} (as in ds_configs/zero2_offload.json)',
        False: 'no "offload_optimizer" (as in ds_configs/zero2.json)',
    },
    "checkpoints_on_host": {
        True: '"activation_checkpointing": {"cpu_checkpointing": true}',
        False: '"activation_checkpointing": {"cpu_checkpointing": false}',
    },
    "mlp_tile": {MLP_TILE: f'"tiled_mlp": {{"tokens_per_tile": {MLP_TILE}}}'},
    "kept_attention_layers": {0: '"keep_attention": false'},
}
"""The settings that move a rank's memory between the GPU and the host, by :func:`estimate_memory` argument: each
value a refusal may propose and the config text that sets it (the optimizer state and the checkpoints either way,
the MLP's tile and the kept attention only down)."""


def _choices(levers: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every setting of :data:`LEVERS` from ``levers`` (a config's), fewest changes first (``levers`` itself first)."""
    options = []
    for name, proposed in LEVERS.items():
        current = levers[name]
        values = [current] + [v for v in proposed if v != current]
        if name == "checkpoints_on_host" and levers["checkpoint_every"] is None:
            values = [current]  # nothing checkpointed: nothing to move
        options.append([(name, v) for v in values])
    combos = [dict(levers) | dict(c) for c in itertools.product(*options)]
    return sorted(combos, key=lambda c: sum(c[k] != levers[k] for k in LEVERS))


AUTO_TILES = (65536, 32768, 16384, 8192)
"""The MLP tiles ``"tokens_per_tile": "auto"`` tries after none, largest (fewest MLP passes) first."""


@dataclass(frozen=True)
class Machine:
    """Where a rank runs: its GPU's bytes, its node's RAM, and the ranks that share that RAM."""

    device_bytes: int
    host_bytes: int
    ranks_per_host: int

    def needs(self, e: MemoryEstimate, offload: bool) -> tuple[int, int]:
        """A rank's GPU peak and its node's host memory (every local rank's pinned checkpoints and offloaded state;
        ``offload``: the optimizer state is on the host)."""
        return e.total, self.ranks_per_host * (e.host_checkpoints + (e.host_state if offload else 0))

    def fits(self, peaks: tuple[int, int]) -> bool:
        """Whether :meth:`needs`' peaks fit: under :data:`FILL` of the GPU and :data:`HOST_FILL` of the RAM."""
        return peaks[0] <= FILL * self.device_bytes and peaks[1] <= HOST_FILL * self.host_bytes


def decide_auto(
    estimate: Callable[..., MemoryEstimate], levers: Mapping[str, Any], machine: Machine, *, kept_layers: int
) -> tuple[dict[str, Any], list[str]]:
    """The config's ``"auto"`` levers decided by the estimate (arguments as :func:`check_memory`): ``mlp_tile``
    ``"auto"`` becomes ``None`` where the step fits untiled, else the largest of :data:`AUTO_TILES` that fits (the
    smallest where none does: the check then names what else would); ``kept_attention_layers`` ``"auto"`` becomes
    ``kept_layers`` (the sparse layers the recomputation could skip) where the step still fits with them, else 0.
    Returns the levers and a line for the banner for each decision."""
    levers, notes = dict(levers), []

    def peaks(**changes: Any) -> tuple[int, int]:
        choice = levers | changes
        return machine.needs(estimate(**choice), choice["offload"])

    limit = f"{FILL * machine.device_bytes / GiB:.0f} GiB"
    if levers["mlp_tile"] == "auto":
        by_tile = {t: peaks(mlp_tile=t, kept_attention_layers=0) for t in (None, *AUTO_TILES)}
        levers["mlp_tile"] = next((t for t, tiled in by_tile.items() if machine.fits(tiled)), AUTO_TILES[-1])
        peak = f"{by_tile[None][0] / GiB:.0f} GiB"
        if levers["mlp_tile"] is None:
            notes.append(f"memory    tiled_mlp auto: untiled, estimated peak {peak} of the {limit} a step may fill")
        else:
            notes.append(f"memory    tiled_mlp auto: tiles of {levers['mlp_tile']} tokens (untiled the estimated peak "
                         f"is {peak}, over the {limit} a step may fill)")  # fmt: skip
    if levers["kept_attention_layers"] == "auto":
        kept = peaks(kept_attention_layers=kept_layers)
        room = kept_layers > 0 and machine.fits(kept)
        levers["kept_attention_layers"] = kept_layers if room else 0
        if kept_layers == 0:
            why = "nothing to keep (the ring path and dense layers recompute)"
        else:
            extra = (kept[0] - peaks(kept_attention_layers=0)[0]) / GiB
            why = (f"kept in {kept_layers} sparse layers (+{extra:.1f} GiB, estimated peak {kept[0] / GiB:.0f} GiB)"
                   if room else f"not kept: it needs {extra:.1f} GiB more, estimated peak {kept[0] / GiB:.0f} GiB, "
                   f"over the {limit} a step may fill")  # fmt: skip
        notes.append(f"memory    keep_attention auto: {why}")
    return levers, notes


def check_memory(
    estimate: Callable[..., MemoryEstimate], levers: Mapping[str, Any], machine: Machine, *, source: str, seqlen: int
) -> str | None:
    """Whether a rank's step fits ``machine`` (:meth:`Machine.fits`): ``estimate(**levers)`` (:func:`estimate_memory`
    with the config's levers: ``offload``, ``checkpoints_on_host``, ``checkpoint_every``, ``mlp_tile``,
    ``kept_attention_layers``).

    It fits: returns a note when the optimizer state is offloaded but would fit on the GPU and offloading costs at
    least 0.05 s a step (naming that time), else ``None``. It does not: raises ``ConfigError`` of one line with the
    estimate and the settings of :data:`LEVERS` closest to the config's that fit (the fewest changes, each with its
    peaks), or, where none does, the smallest GPU peak any reaches."""
    from .config import ConfigError

    def said(gpu: int, host: int) -> str:
        return f"estimated peak {gpu / GiB:.0f} GiB" + (f", {host / GiB:.0f} GiB of the node's RAM" if host else "")

    current = estimate(**levers)
    gpu, host = machine.needs(current, levers["offload"])
    if machine.fits((gpu, host)):
        if not levers["offload"]:
            return None
        on_gpu = current.total + current.offloadable + current.offloaded_gradients
        seconds = OFFLOAD_SECONDS_PER_BILLION * current.offloadable / STATE_BYTES / 1e9
        if on_gpu > FILL * machine.device_bytes or seconds < 0.05:  # a small model: nothing worth a note to gain
            return None
        return (
            f"note: {source} offloads the optimizer state ({current.offloadable / GiB:.1f} GiB) to the CPU, but it "
            f"fits on this GPU (estimated peak {on_gpu / GiB:.0f} of {machine.device_bytes / GiB:.0f} GiB at {seqlen} "
            f"tokens); without \"offload_optimizer\" (ds_configs/zero2.json) each optimizer step is about "
            f"{seconds:.1f} s shorter"
        )
    problem = (
        f"{source}: a rank needs about {gpu / GiB:.0f} GiB of GPU memory at {seqlen} tokens ({current.describe()}"
        + (f"; the node {host / GiB:.0f} GiB of RAM" if host else "")
        + f"), more than a step can fill ({FILL:.0%} of the GPU's {machine.device_bytes / GiB:.0f} GiB, "
        f"{HOST_FILL:.0%} of the node's {machine.host_bytes / GiB:.0f} GiB of RAM)"
    )
    fitting, smallest = [], None
    for choice in _choices(levers)[1:]:
        peaks = machine.needs(estimate(**choice), choice["offload"])
        if smallest is None or peaks[0] < smallest[0]:
            smallest = peaks
        changes = [LEVERS[k][choice[k]] for k in LEVERS if choice[k] != levers[k]]
        # The closest settings that fit: those that change the fewest things.
        if machine.fits(peaks) and (not fitting or len(changes) == len(fitting[0][0])):
            fitting.append((changes, peaks))
    spread = 'shorten --seqlen, or spread each sequence over more GPUs ("parallel": {"sequence_parallel_size"})'
    if fitting:
        named = ", or ".join(" and ".join(changes) + f" ({said(*peaks)})" for changes, peaks in fitting)
        raise ConfigError(f"{problem}; it fits with {named}; or {spread}")
    raise ConfigError(f"{problem}; no setting here makes it fit (at best {said(*smallest)}): {spread}")


def this_machine() -> Machine | None:
    """Where this rank runs, for :func:`plan_memory`: the GPU of ``LOCAL_RANK``, the node's RAM and the launch's
    ``LOCAL_WORLD_SIZE`` (``LOCAL_SIZE``) ranks on it; ``None`` without a CUDA device."""
    import os

    import torch

    if not torch.cuda.is_available():
        return None
    return Machine(
        device_bytes=torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory,
        host_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        ranks_per_host=int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1),
    )


def auto_off(mtraining: MTrainingConfig) -> MTrainingConfig:
    """``mtraining`` with its ``"auto"`` memory settings as off: the MLP untiled, nothing kept (what
    :func:`plan_memory` runs without a GPU); values written stay."""
    tile, keep = mtraining.tiled_mlp.tokens_per_tile, mtraining.activation_checkpointing.keep_attention
    return _decided(mtraining, None if tile == "auto" else tile, keep is True)


def plan_memory(
    ds_config: Mapping[str, Any],
    mtraining: MTrainingConfig,
    model_config,
    shape: MeshShape,
    *,
    tokens: int,
    seqlen: int,
    source: str,
    fused: bool,
    params: int | None = None,
    machine: Machine | None = None,
) -> tuple[MTrainingConfig, list[str]]:
    """The start-up memory plan of a run, the one the training job (``training.plan``) and the Trainer route
    (``integration.hf_trainer.plan_trainer``) both make.

    Args:
        ds_config: the DeepSpeed config with its ``"auto"`` values decided (ZeRO stage, ``reduce_bucket_size``,
            bf16 / fp16, ``offload_optimizer``, ``activation_checkpointing.cpu_checkpointing`` are read).
        mtraining: its ``"mtraining"`` section.
        model_config: the transformers config of the model (its sizes and layer count).
        shape: the mesh's degrees: ZeRO partitions over all ``shape.world`` ranks (``MeshMPU``), each rank holds
            ``tokens / shape.sp`` tokens, and the kept attention serves the one-device path only (``ring == 1``).
        tokens: one micro-batch's tokens (micro-batch x sequence length); seqlen: the sequence length (messages).
        source: the config's name, for messages.
        fused: Liger's fused kernels and loss are used (``FusedKernels.apply``).
        params: the model's parameter count (default :func:`count_parameters` of ``model_config``).
        machine: where the rank runs (default :func:`this_machine`; ``None`` there: no GPU).

    Returns:
        ``mtraining`` with ``tiled_mlp.tokens_per_tile`` (an int or ``None``) and
        ``activation_checkpointing.keep_attention`` (a bool) decided, and the banner's lines on how
        (:func:`decide_auto`) and on whether the config fits (:func:`check_memory`'s note). Without a GPU (no
        ``machine`` and none here): :func:`auto_off`, unchecked, and no lines.

    Raises:
        ConfigError: the step does not fit the machine (:func:`check_memory`: one line naming what would fit).
    """
    machine = this_machine() if machine is None else machine
    if machine is None:
        return auto_off(mtraining), []
    estimate, levers, keepable = _step_levers(ds_config, mtraining, model_config, shape, tokens, fused, params)
    levers, notes = decide_auto(estimate, levers, machine, kept_layers=keepable)
    note = check_memory(estimate, levers, machine, source=source, seqlen=seqlen)
    return _decided(mtraining, levers["mlp_tile"], levers["kept_attention_layers"] > 0), notes + [note] * bool(note)


def step_estimate(
    ds_config: Mapping[str, Any],
    mtraining: MTrainingConfig,
    model_config,
    shape: MeshShape,
    *,
    tokens: int,
    fused: bool,
    params: int | None = None,
) -> MemoryEstimate:
    """The estimate of a rank's step with the levers as the config sets them, every ``"auto"`` already decided
    (:func:`plan_memory`'s result): what a benchmark prints beside the step's measured peak. Arguments as
    :func:`plan_memory`'s."""
    estimate, levers, _ = _step_levers(ds_config, mtraining, model_config, shape, tokens, fused, params)
    if "auto" in (levers["mlp_tile"], levers["kept_attention_layers"]):
        raise ValueError("step_estimate needs the memory settings decided (plan_memory), not \"auto\"")
    return estimate(**levers)


def _step_levers(
    ds_config: Mapping[str, Any],
    mtraining: MTrainingConfig,
    model_config,
    shape: MeshShape,
    tokens: int,
    fused: bool,
    params: int | None,
) -> tuple[Callable[..., MemoryEstimate], dict[str, Any], int]:
    """:func:`estimate_memory` bound to the run's model, ZeRO and precision, the config's levers, and the sparse
    layers whose attention could be kept."""
    from functools import partial

    from .integration.deepspeed import compute_dtype, optimizer_offloaded, zero_stage
    from .integration.ds_config import cpu_checkpointing

    checkpointing, tiled = mtraining.activation_checkpointing, mtraining.tiled_mlp
    zero = ds_config.get("zero_optimization", {})
    layers = model_config.num_hidden_layers
    # The kept attention serves the one-device path's sparse layers only (the ring and dense layers recompute).
    sparse = sum(mtraining.sparse_attention.for_layer(i).pattern != "dense" for i in range(layers))
    keepable = sparse if shape.ring == 1 and checkpointing.every is not None else 0
    keep = checkpointing.keep_attention
    levers = {
        "offload": optimizer_offloaded(ds_config),
        "checkpoints_on_host": cpu_checkpointing(ds_config),
        "checkpoint_every": checkpointing.every,
        "mlp_tile": tiled.tokens_per_tile,
        "kept_attention_layers": "auto" if keep == "auto" else keepable if keep else 0,
    }
    # ZeRO partitions over every DP x SP rank (integration.deepspeed.MeshMPU), not over the data-parallel degree.
    estimate = partial(
        estimate_memory, model_config, params=count_parameters(model_config) if params is None else params,
        zero_stage=zero_stage(ds_config), dp=shape.world, tokens=tokens // shape.sp, fused=fused,
        dtype_bytes=compute_dtype(ds_config).itemsize,
        reduce_bucket=int(zero.get("reduce_bucket_size", REDUCE_BUCKET)),
        pinned_offload=bool(zero.get("offload_optimizer", {}).get("pin_memory", False)),  # DeepSpeed's default
        sub_group=int(zero.get("sub_group_size", SUB_GROUP)),
    )  # fmt: skip
    return estimate, levers, keepable


def _decided(mtraining: MTrainingConfig, tile: int | None, keep: bool) -> MTrainingConfig:
    """``mtraining`` with the MLP's tile and ``keep_attention`` set to what the run runs."""
    checkpointing = mtraining.activation_checkpointing.model_copy(update={"keep_attention": keep})
    return mtraining.model_copy(
        update={"tiled_mlp": mtraining.tiled_mlp.model_copy(update={"tokens_per_tile": tile}),
                "activation_checkpointing": checkpointing}
    )  # fmt: skip


def out_of_memory_message(
    *, seqlen: int, offload: bool, fused: bool, checkpoints_on_host: bool = True, tiled: bool = True
) -> str:
    """The one line for a step that ran out of GPU memory: how much this GPU has and held, and the fixes that apply
    (offload when the state is on the GPU, the fused kernels when they are off, the checkpoints in CPU memory and the
    MLP in tiles when they are not, a shorter or wider-spread sequence)."""
    import torch

    fixes = [
        text
        for text, applies in (
            (f"offload the optimizer state ({LEVERS['offload'][True]})", not offload),
            ('turn the fused kernels on ("fused_kernels": {"enabled": true})', not fused),
            (f"keep the activation checkpoints in CPU memory ({LEVERS['checkpoints_on_host'][True]})",
             not checkpoints_on_host),
            (f"run the MLP in tiles ({LEVERS['mlp_tile'][MLP_TILE]})", not tiled),
            ('shorten --seqlen, or spread each sequence over more GPUs ("parallel": {"sequence_parallel_size"})', True),
        )
        if applies
    ]  # fmt: skip
    held = ""
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        held = f" ({torch.cuda.max_memory_allocated() / GiB:.0f} of this GPU's {total / GiB:.0f} GiB allocated)"
    return f"out of GPU memory in a step of {seqlen} tokens a sequence{held}: " + "; or ".join(fixes)
