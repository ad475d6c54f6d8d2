"""The run's plan: every input checked before any process group exists or any file is written.

:func:`plan` reads the DeepSpeed JSON and our ``"mtraining"`` section, resolves the model, the mesh shape against the
launch, the sequence length against the layout and the model's context, the batch sizes, the checkpoint state and
the data; whatever is wrong raises one of :data:`INPUT_ERRORS` with a one-line message naming the fix.
:func:`describe` is the start-up banner of a plan.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config import ConfigError, MTrainingConfig
from ..data.packing import PackedDataError
from ..integration.deepspeed import compute_dtype, deepspeed_config, optimizer_offloaded, zero_stage
from ..integration.ds_config import cpu_checkpointing
from ..integration.fused_kernels import FusedKernels, fused_kernels_note
from ..integration.model_loading import ModelError, ModelSpec, resolve_model
from ..memory import plan_memory
from ..models import ContextError, head_dim
from ..parallel.layout import Layout
from ..parallel.mesh import MeshError, MeshShape
from ..sparse.dense import dense_kernel
from .checkpoints import CheckpointError, Checkpoints

if TYPE_CHECKING:
    from .auto_plan import AutoPlan
from .data import TrainData, build_data, build_heldout, describe_data
from .manifest import run_settings
from .settings import TrainSettings, UsageError

__all__ = ["INPUT_ERRORS", "VOCAB", "Plan", "describe", "plan"]

VOCAB = 512
"""``tiny-qwen2``'s vocabulary (every other model brings its own)."""

INPUT_ERRORS = (
    ConfigError,
    MeshError,
    CheckpointError,
    UsageError,
    ContextError,
    ModelError,
    FileNotFoundError,
    ModuleNotFoundError,
    PackedDataError,
)
"""What the inputs or the installation can be wrong with: one ``error:`` line and exit status 2, no traceback."""


@dataclass
class Plan:
    """Everything validated before any process group exists or any file is written.

    Attributes:
        settings: the run's settings.
        ds_config: the DeepSpeed config with its ``"auto"`` values decided (:attr:`notes` says how).
        mtraining: our ``"mtraining"`` section.
        shape: the mesh's degrees (data, Ulysses, ring) for this launch's world size.
        spec: the resolved model.
        micro_batch, accumulation: sequences per micro-batch and micro-batches per optimizer step.
        checkpoints: the run's checkpoint folder, its state checked against :attr:`settings`.
        data: the training rows.
        fused: whether Liger's fused RMSNorm, SwiGLU and RoPE replace transformers' modules, and the banner's line.
        notes: how the config's ``"auto"`` values were decided (for the banner).
        heldout: the held-out rows and their tokens' document ids, both integer ``[M, N]``, else ``None``.
        auto: the shape ``"parallel": {"plan": "auto"}`` chose (already in :attr:`mtraining`), else ``None``.
    """

    settings: TrainSettings
    ds_config: dict
    mtraining: MTrainingConfig
    shape: MeshShape
    spec: ModelSpec
    micro_batch: int
    accumulation: int
    checkpoints: Checkpoints
    data: TrainData
    fused: FusedKernels
    notes: list[str] = field(default_factory=list)
    heldout: tuple[torch.Tensor, torch.Tensor] | None = None
    auto: AutoPlan | None = None

    @property
    def zero_stage(self) -> int:
        return zero_stage(self.ds_config)

    def layout(self) -> Layout | None:
        """The token layout batches are cut with under sequence parallelism (``None`` on one rank a sequence)."""
        if self.shape.sp == 1:
            return None
        return self.shape.layout(
            self.settings.seqlen,
            kind=self.mtraining.parallel.layout,
            block_size=self.mtraining.sparse_attention.block_size,
            stripe=self.mtraining.effective_stripe_size,
        )


def plan_model(settings: TrainSettings) -> ModelSpec:
    """The resolved model, with the checks that need it: what the sparse attention serves, ``data`` only with a
    tokenizer, and a sequence length within the model's (stretched) context."""
    from ..models import RopeScaling, check_context

    rope = RopeScaling(kind=settings.rope_kind, factor=settings.rope_factor) if settings.rope_kind else None
    spec = resolve_model(settings.model, rope=rope, vocab_size=VOCAB, max_positions=max(settings.seqlen, 8192))
    for flag, value in (("--data", settings.data), ("--heldout", settings.heldout)):
        if value and spec.tokenizer_dir is None:
            raise UsageError(
                f"{flag} needs a --model with a tokenizer (packed rows are token ids); {spec.name} has none"
            )
    check_context(spec.config, settings.seqlen, spec.name, rope, fix=_resumed_stretch(settings))
    return spec


def _resumed_stretch(settings: TrainSettings) -> str | None:
    """For a resumed run without a stretch whose checkpoint has one: the flags that checkpoint trained with (the fix
    for a length past the model's context), read from the latest tag's manifest; ``None`` otherwise."""
    from .manifest import ManifestError, read_manifest, rope_flags

    if not settings.resume or settings.rope_kind:
        return None
    checkpoints = Checkpoints(Path(settings.output_dir) / "checkpoints")
    try:
        tag = checkpoints.latest_tag()
        recorded = read_manifest(checkpoints.directory / tag)["settings"] if tag else {}
    except (CheckpointError, ManifestError, OSError):
        return None  # the checkpoint's own check names what is wrong with it
    if not recorded.get("rope_kind"):
        return None
    flags = rope_flags(recorded["rope_kind"], recorded.get("rope_factor"))
    return f"checkpoint {checkpoints.directory / tag} trained with {flags}: resume with {flags}"


def plan(settings: TrainSettings) -> Plan:
    """Validate the config, the degrees against the launch (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``), the sequence
    length and the checkpoint state; load the data."""
    path = settings.deepspeed
    ds_config, mtraining, decided = deepspeed_config(path, settings.steps)  # as a library user's engine gets it
    stage = zero_stage(ds_config)
    parallel = mtraining.parallel
    spec = plan_model(settings)
    config = spec.config
    mtraining.sparse_attention.check_layers(config.num_hidden_layers, spec.name, path)
    fused = fused_kernels_note(config, mtraining.fused_kernels.enabled)
    if mtraining.data.document_masking and spec.tokenizer_dir is None:
        raise UsageError(
            f"{path}: mtraining.data.document_masking needs packed rows of documents, but {spec.name} has no "
            "tokenizer and trains on synthetic copies (one sequence a row); pass a --model with a tokenizer, or set "
            "document_masking false"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")  # torchrun's or deepspeed's name
    micro = int(ds_config.get("train_micro_batch_size_per_gpu", 1))
    accumulation = int(ds_config.get("gradient_accumulation_steps", 1))
    auto = None
    if parallel.plan == "auto":
        from .auto_plan import choose, memory_assumptions, model_shape  # the simulator: only where it is asked for

        auto = choose(
            parallel, world=world, gpus_per_node=int(local) if local else world, seqlen=settings.seqlen,
            model=model_shape(config), block_size=mtraining.sparse_attention.block_size,
            stripe=mtraining.effective_stripe_size, accumulation=accumulation,
            memory=memory_assumptions(ds_config, mtraining.tiled_mlp.tokens_per_tile, fused.apply), source=str(path),
        )  # fmt: skip
        mtraining = mtraining.model_copy(update={"parallel": auto.parallel})
        parallel = auto.parallel
    shape = MeshShape.build(
        world=world,
        ulysses=parallel.ulysses_degree,
        ring=parallel.ring_degree,
        q_heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        inner_ring=parallel.inner_ring_size,
        local_world_size=int(local) if local else None,
        kv_exchange=parallel.kv_exchange,
    )
    shape.layout(  # the length must split into the layout's stripes, whatever the degrees
        settings.seqlen,
        kind=parallel.layout,
        block_size=mtraining.sparse_attention.block_size,
        stripe=mtraining.effective_stripe_size,
    )
    if "train_batch_size" in ds_config and ds_config["train_batch_size"] != micro * accumulation * shape.dp:
        raise ConfigError(
            f"{path}: train_batch_size={ds_config['train_batch_size']} != train_micro_batch_size_per_gpu={micro} "
            f"x gradient_accumulation_steps={accumulation} x data-parallel degree {shape.dp}; drop it or fix it"
        )
    recorded = run_settings(  # what every manifest records and a resume must match (or, for notes, may change)
        model_config=config,
        world_size=shape.world,
        dp_degree=shape.dp,
        ulysses_degree=shape.ulysses,
        ring_degree=shape.ring,
        hierarchical_ring=shape.hierarchical,
        zero_stage=stage,
        seqlen=settings.seqlen,
        micro_batch=micro,
        gradient_accumulation=accumulation,
        seed=settings.seed,
        sparse_attention=mtraining.sparse_attention.model_dump(mode="json"),
        ds_config=ds_config,
        document_masking=mtraining.data.document_masking,
        rope_kind=settings.rope_kind,
        rope_factor=settings.rope_factor,
    )
    checkpoints = Checkpoints(Path(settings.output_dir) / "checkpoints", run=recorded)
    if settings.resume:
        checkpoints.check()
    elif checkpoints.latest_tag() is not None:
        raise UsageError(
            f"{checkpoints.directory} already holds checkpoints; pass --resume to continue them, or another --output-dir"
        )
    data = build_data(settings, spec)
    heldout = build_heldout(settings, spec)
    # The "auto" memory settings decided, and the config refused where it cannot fit (as the Trainer route does).
    mtraining, memory = plan_memory(ds_config, mtraining, config, shape, tokens=micro * settings.seqlen,
                                    seqlen=settings.seqlen, source=str(path), fused=fused.apply)  # fmt: skip
    notes = [n for n in (mtraining.sparse_attention.layer0_note(), *memory, auto and auto.describe()) if n]
    if notes and os.environ.get("RANK", "0") == "0":
        print("\n".join(notes), flush=True)  # after every check: a run refused prints its one error line only
    return Plan(
        settings, ds_config, mtraining, shape, spec, micro, accumulation, checkpoints, data, fused, decided, heldout,
        auto,
    )


def _describe_checkpointing(p: Plan) -> str:
    """Which decoder layers checkpoint, where the checkpoints live, and what the recomputation keeps."""
    checkpointing = p.mtraining.activation_checkpointing
    every, layers = checkpointing.every, p.spec.config.num_hidden_layers
    if every is None:
        return "no activation checkpointing (every layer keeps its activations)"
    which = "every decoder layer"
    if every > 1:
        which = f"every {every}th decoder layer ({-(-layers // every)} of {layers})"
    where = "CPU memory (cpu_checkpointing)" if cpu_checkpointing(p.ds_config) else "GPU memory"
    kept = ", keeping the sparse attention" if checkpointing.keep_attention else ""
    return f"activation checkpointing on {which}, checkpoints in {where}{kept}"


def describe(p: Plan) -> str:
    """The start-up banner: model, data, mesh, engine, and the effective sparse settings per run of layers."""
    sparse = p.mtraining.sparse_attention
    c = p.spec.config
    tiled = p.mtraining.tiled_mlp.tokens_per_tile
    lines = [
        f"model     {p.spec.name} ({'weights loaded' if p.spec.pretrained else 'random init'}): {c.num_hidden_layers} layers, hidden {c.hidden_size}, heads {c.num_attention_heads} "
        f"(KV {c.num_key_value_heads}), vocab {c.vocab_size}{_describe_rope(p.settings)}; "
        f"{_describe_checkpointing(p)}{'' if tiled is None else f', MLP in tiles of {tiled} tokens'}",
        f"data      {describe_data(p.settings, p.spec)}{_describe_documents(p)}, {p.settings.seqlen} tokens/sequence, "
        f"micro-batch {p.micro_batch}, accumulation {p.accumulation}",
        f"mesh      {p.shape.describe()}, layout {p.mtraining.parallel.layout} (stripe {p.mtraining.effective_stripe_size}), "
        f"ring columns {p.mtraining.parallel.ring_columns}",
        f"engine    {p.settings.deepspeed}: ZeRO-{p.zero_stage}"
        f"{' + CPU optimizer offload' if optimizer_offloaded(p.ds_config) else ''}, "
        f"clipping {p.ds_config.get('gradient_clipping', 0)}, {', '.join(p.notes)}",
        f"kernels   {p.fused.note}; dense attention: {_describe_dense(p)}",
    ]
    settings = [sparse.for_layer(layer).describe() for layer in range(c.num_hidden_layers)]
    first = 0
    for layer in range(1, len(settings) + 1):  # one line per run of consecutive layers with the same settings
        if layer == len(settings) or settings[layer] != settings[first]:
            layers = f"layer {first}" if layer - first == 1 else f"layers {first}-{layer - 1}"
            lines.append(f"{layers:<13} {settings[first]}")
            first = layer
    return "\n".join(lines)


def _describe_dense(p: Plan) -> str:
    """The banner's note of the kernel the dense layers run (``sparse.dense``) on this machine, in the run's dtype."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kernel = dense_kernel(device, compute_dtype(p.ds_config), head_dim(p.spec.config))
    return {"flash_attn_4": "flash-attn-4", "sdpa": "SDPA (cuDNN first)"}[kernel]


def _describe_documents(p: Plan) -> str:
    if p.spec.tokenizer_dir is None:
        return ""
    if p.mtraining.data.document_masking:
        return ", documents masked (positions restart, no attention or label across them)"
    return ", documents not masked (one causal sequence a row)"


def _describe_rope(settings: TrainSettings) -> str:
    """The banner's note of the RoPE stretch (what export reads back from the checkpoints)."""
    return f", RoPE {settings.rope_kind} x{settings.rope_factor:g}" if settings.rope_kind else ""
