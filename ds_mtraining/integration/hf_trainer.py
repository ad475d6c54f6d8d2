"""The sparse attention and the sequence-parallel mesh inside Hugging Face's ``transformers.Trainer`` (and TRL's
``SFTTrainer``): :class:`MTrainingTrainer`, or :class:`MTrainingMixin` in front of any ``Trainer`` subclass.

::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="mtraining")
    args = TrainingArguments(output_dir, deepspeed="ds_configs/zero2.json", ...)   # JSON with its "mtraining" section
    MTrainingTrainer(model=model, args=args, train_dataset=rows).train()

What it does, as ``ds_mtraining.training.Trainer`` (``launch/train.py``) does it:

- the mesh of the DeepSpeed JSON's ``"mtraining"`` section (``parallel``: Ulysses x ring degrees, inner ring, K/V
  exchange, layout), checked against the launch's world size and the model's heads; the engine is built over it
  (``integration.deepspeed.MeshMPU``: ZeRO partitions over DP x SP, gradients summed over the sequence ranks, with
  ``sum_sequence_parallel_gradients``' correction of ZeRO-3's reduce-scatter);
- each batch laid out and sharded per sequence rank (:class:`MeshCollator` around the Trainer's data collator:
  ``integration.batch.make_batch``: striped layout, padding, global position ids, packed documents from restarting
  position ids), the data loader sharded over the data-parallel ranks only (the ranks of a sequence group read the
  same rows);
- the attention handle (``MTrainingAttention``, one per sequence length) passed to every forward, and the loss
  tiled (or Liger's fused loss with ``fused_kernels``) without ``[B, N, vocab]`` logits (``integration.loss``); each
  rank backpropagates its share of the sequence's token mean, while the value the Trainer logs is the whole
  sequence's;
- activation checkpointing that reuses each layer's index (``mtraining.activation_checkpointing``), the tiled MLP,
  CPU checkpoints (``"activation_checkpointing": {"cpu_checkpointing": true}``);
- the attention's per-layer statistics (density and recall over the sparse layers, ring imbalance) added to the
  Trainer's training logs.

Checkpoints are the Trainer's own (``save_steps``, ``resume_from_checkpoint``: DeepSpeed's checkpoint written and
read by the Trainer); ``save_model`` writes a folder plain transformers loads (under ZeRO-3 the weights are gathered:
``stage3_gather_16bit_weights_on_model_save`` is turned on unless the JSON sets it), with the model's config as
trained, so a RoPE stretch (``ds_mtraining.models.apply_rope_scaling``) is in it.

Why a ``Trainer`` subclass (a mixin) and a collator, written by hand, and not Accelerate's sequence-parallel backend:
in accelerate 1.16 ``ParallelismConfig.sp_backend`` accepts ``"deepspeed"`` only (``parallelism_config.py``:
``valid_sp_backends = ["deepspeed"]``), and ``Accelerator._prepare_deepspeed`` then hard-wires DeepSpeed's ALST:
``UlyssesSPAttentionHF.register_with_transformers`` replaces the model's attention with DeepSpeed's Ulysses wrapper
and builds DeepSpeed's own mpu, and ``UlyssesSPDataLoaderAdapter`` cuts contiguous shards; transformers 5.25's
``Trainer.compute_loss`` then calls ``deepspeed_sp_compute_loss`` on full logits. None of it can be replaced: there
is no registry of backends, no way to hand ``deepspeed.initialize`` another mpu, and the ring, the striped layout
and the tiled loss have no place in it. The Trainer's documented extension points carry the rest: ``compute_loss``,
``get_*_dataloader``, ``get_total_train_batch_size``, ``log``; the data collator does the layout. The one thing
they do not reach is the ``mpu`` of ``deepspeed.initialize``, which Accelerate calls with none (and with ALST's
when its backend is on): while :meth:`MTrainingMixin.train` (``evaluate``, ``predict``) runs,
``deepspeed.initialize`` is wrapped to add ``MeshMPU(mesh)``, fix ``train_batch_size`` to the data-parallel degree
and set up the sequence-parallel gradient sum (:meth:`MTrainingMixin._engine_over_mesh`); outside those calls
DeepSpeed is left as it was.

The GPU memory plan is the job's (``ds_mtraining.memory.plan_memory``, one function both routes call): given the
sequence length (``MTrainingTrainer(..., seqlen=N)``; by default TRL's ``SFTConfig.max_length``), ``"auto"`` of
``keep_attention`` and ``tiled_mlp.tokens_per_tile`` is decided from the estimate of a rank's step
(``per_device_train_batch_size`` x ``seqlen`` tokens over the mesh) as the job decides it, and a config that
cannot fit is refused at start-up in one line naming what would fit; world process zero prints the plan's lines.
Without a length there is nothing to estimate: those ``"auto"`` values count as off (untiled, the attention
recomputed) and a line says how to have them decided.

What the job decides that this route does not: ``parallel.plan: "auto"`` is refused (write the degrees); the
DeepSpeed section's own ``"auto"`` values are the Trainer's (``TrainingArguments``), as in any Trainer script.
Fused kernels: Liger's classes replace transformers' at model construction, so build the model inside
``integration.fused_kernels.use_fused_kernels(config, enabled)``; the loss follows ``fused_kernels.enabled`` itself.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer
from transformers.data.data_collator import default_data_collator

from ..config import SECTION, ConfigError, MissingSectionError, MTrainingConfig
from ..parallel.layout import Layout
from ..parallel.mesh import Mesh, MeshCoordinates, MeshShape
from .batch import IGNORE, Batch, make_batch
from .transformers import NAME, MTrainingAttention

__all__ = [
    "BATCH_KEY",
    "MTrainingMixin",
    "MTrainingTrainer",
    "MeshCollator",
    "TrainerPlan",
    "plan_trainer",
    "trainer_arguments",
]

BATCH_KEY = "mtraining_batch"
"""The key of a collated batch that holds this rank's :class:`~ds_mtraining.integration.batch.Batch`."""


@dataclass(frozen=True)
class TrainerPlan:
    """The checked inputs of a Trainer run (:func:`plan_trainer`).

    Attributes:
        mtraining: the DeepSpeed JSON's ``"mtraining"`` section.
        shape: the mesh's degrees for this launch.
        source: where the JSON came from (its path, or ``"<dict>"``), for messages.
        fused: whether the loss is Liger's fused linear cross-entropy (``fused_kernels``).
        cpu_checkpointing: DeepSpeed's ``activation_checkpointing.cpu_checkpointing``.
        notes: the start-up lines of the memory plan (how its ``"auto"`` values were decided, or that they count
            as off), printed by world process zero.

    :attr:`mtraining` holds the memory settings the run uses: ``activation_checkpointing.keep_attention`` a bool,
    ``tiled_mlp.tokens_per_tile`` an int or ``None`` (``"auto"`` decided by :func:`plan_trainer`).
    """

    mtraining: MTrainingConfig
    shape: MeshShape
    source: str
    fused: bool
    cpu_checkpointing: bool
    notes: tuple[str, ...] = ()


def _load(
    deepspeed: str | os.PathLike[str] | Mapping[str, Any] | None,
) -> tuple[Mapping[str, Any], MTrainingConfig, str]:
    """The DeepSpeed config of ``TrainingArguments.deepspeed`` (a path or a dict), its ``"mtraining"`` section and
    the config's name for messages; a missing section is one line."""
    from .deepspeed import load_config

    if deepspeed is None:
        raise ValueError(
            'MTrainingTrainer needs TrainingArguments(deepspeed=...): a DeepSpeed JSON with an "mtraining" section, '
            "e.g. ds_configs/zero2.json"
        )
    source = "<dict>" if isinstance(deepspeed, Mapping) else os.fspath(deepspeed)
    try:
        if isinstance(deepspeed, Mapping):
            return deepspeed, MTrainingConfig.from_deepspeed_config(deepspeed), source
        return (*load_config(deepspeed), source)
    except MissingSectionError:
        pass
    # The config's own message goes on with an example section over several lines: here one line names the fix.
    raise ConfigError(
        f'DeepSpeed config {source} has no "{SECTION}" section, where the sparse attention and the mesh are set; '
        'add one, e.g. the "mtraining" object of ds_configs/zero2.json'
    ) from None


def plan_trainer(
    deepspeed: str | os.PathLike[str] | Mapping[str, Any] | None,
    model: torch.nn.Module,
    *,
    world: int,
    local_world: int | None = None,
    seqlen: int | None = None,
    micro_batch: int = 1,
    filled: Mapping[str, Any] | None = None,
) -> TrainerPlan:
    """Check a Trainer run before any process group is used: the DeepSpeed config (``TrainingArguments.deepspeed``)
    and its ``"mtraining"`` section, the model against the attention, the degrees against ``world`` processes
    (``local_world`` per node: the hierarchical ring's inner size). Each problem is one line naming the fix.

    With ``seqlen`` (tokens per sequence; ``micro_batch`` sequences a micro-batch) the GPU memory plan is the job's
    (``ds_mtraining.memory.plan_memory``): the ``"auto"`` of ``keep_attention`` and ``tiled_mlp.tokens_per_tile``
    decided by the estimate of a rank's step, a config that cannot fit refused. Without it those ``"auto"`` values
    count as off, and :attr:`TrainerPlan.notes` says so. ``filled``: the config with the Trainer's ``"auto"`` values
    filled in (``TrainingArguments.hf_deepspeed_config.config``), whose bf16 / fp16 the estimate reads (default:
    the config itself).

    Raises:
        ValueError (``ConfigError``, ``MeshError``, ``UnsupportedModelError``): what is wrong and how to fix it
        (``ConfigError`` too where the step cannot fit the GPU).
        FileNotFoundError: no such JSON.
    """
    from ..memory import auto_off, plan_memory
    from .ds_config import cpu_checkpointing
    from .fused_kernels import fused_kernels_note
    from .model_loading import check_supported

    ds_config, mtraining, source = _load(deepspeed)
    parallel = mtraining.parallel
    if parallel.plan == "auto":
        raise ConfigError(
            f'DeepSpeed config {source}: mtraining.parallel.plan "auto" is chosen by launch/train.py only; write '
            'the degrees (ulysses_degree, ring_degree) and "plan": "explicit" for a Trainer script'
        )
    config = getattr(model, "config", None)
    name = type(model).__name__
    if config is None or getattr(config, "_attn_implementation", None) != NAME:
        got = getattr(config, "_attn_implementation", None)
        raise ValueError(
            f'{name} runs attn_implementation={got!r}, not "{NAME}": build it with '
            f'AutoModelForCausalLM.from_pretrained(..., attn_implementation="{NAME}") (after import ds_mtraining)'
        )
    check_supported(config, name)
    mtraining.sparse_attention.check_layers(config.num_hidden_layers, name, source)
    shape = MeshShape.build(
        world=world, ulysses=parallel.ulysses_degree, ring=parallel.ring_degree, q_heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads, inner_ring=parallel.inner_ring_size, local_world_size=local_world,
        kv_exchange=parallel.kv_exchange,
    )  # fmt: skip
    fused = fused_kernels_note(config, mtraining.fused_kernels.enabled).apply
    if seqlen is None:
        notes = _unplanned(mtraining)
        mtraining = auto_off(mtraining)
    else:
        mtraining, notes = plan_memory(
            _engine_view(ds_config, filled, config), mtraining, config, shape, tokens=micro_batch * seqlen,
            seqlen=seqlen, source=source, fused=fused, params=_parameter_count(model),
        )  # fmt: skip
    return TrainerPlan(mtraining, shape, source, fused, cpu_checkpointing(ds_config), tuple(notes))


def _unplanned(mtraining: MTrainingConfig) -> list[str]:
    """The line for a plan without a sequence length where the memory settings hold ``"auto"``: they count as off,
    and how to have them decided."""
    auto = [name for name, value in (
        ("activation_checkpointing.keep_attention", mtraining.activation_checkpointing.keep_attention),
        ("tiled_mlp.tokens_per_tile", mtraining.tiled_mlp.tokens_per_tile),
    ) if value == "auto"]  # fmt: skip
    if not auto:
        return []
    return [
        f'memory    {" and ".join(auto)} "auto" count as off here (the MLP untiled, the attention recomputed): no '
        "sequence length to plan GPU memory with; pass MTrainingTrainer(..., seqlen=N) (TRL: SFTConfig(max_length=N)) "
        "to decide them as launch/train.py does, or write the values in the JSON"
    ]


def _engine_view(
    ds_config: Mapping[str, Any], filled: Mapping[str, Any] | None, model_config: Any
) -> dict[str, Any]:
    """``ds_config`` as the engine will run it, for the memory estimate: bf16 / fp16 as ``filled`` (the Trainer's
    fill of ``"auto"``) has them, and a ``reduce_bucket_size`` of ``"auto"`` as transformers fills it when it builds
    the engine (``hidden_size`` squared)."""
    view = dict(ds_config)
    for section in ("bf16", "fp16"):
        if filled is not None and section in filled:
            view[section] = filled[section]
    zero = dict(view.get("zero_optimization", {}))
    if zero.get("reduce_bucket_size") == "auto":
        zero["reduce_bucket_size"] = model_config.hidden_size * model_config.hidden_size
    view["zero_optimization"] = zero
    return view


def _parameter_count(model: torch.nn.Module) -> int:
    """The model's parameters (each whole under ZeRO-3's partitioning: ``ds_numel``), as ``memory.count_parameters``
    counts its config's without building another model (under ZeRO-3 transformers would build it partitioned)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


@dataclass
class MeshCollator:
    """A data collator that lays out and shards each batch for this rank, around the Trainer's own collator.

    ``collate(features)`` must give ``input_ids`` ``[B, N]`` of whole sequences (the same on the ranks of a sequence
    group: the Trainer's data loader is sharded over the data-parallel ranks only), and may give:

    - ``labels`` ``[B, N]``, unshifted (transformers' convention, ``-100`` masks a token: a prompt, padding); by
      default every next token is a target;
    - ``position_ids`` ``[B, N]`` restarting at each packed document (``DataCollatorWithFlattening``, TRL's
      ``padding_free``): with ``mtraining.data.document_masking`` attention, positions and labels stay inside each
      document; without it a row is one causal sequence;
    - ``attention_mask``: padding at the end of a row only (its tokens get no label; causal attention never lets a
      real token see them); padding anywhere else is refused.

    The result holds this rank's :class:`~ds_mtraining.integration.batch.Batch` under :data:`BATCH_KEY`, and its
    ``input_ids`` and ``labels`` (the Trainer counts tokens and finds labels there).
    """

    collate: Callable[[list[Any]], Mapping[str, Any]]
    mtraining: MTrainingConfig
    view: MeshCoordinates | None
    pad_id: int
    _layouts: dict[int, Layout] = field(default_factory=dict, init=False, repr=False)

    def layout(self, seqlen: int) -> Layout | None:
        """The layout of ``seqlen``-token rows (``None`` on one rank a sequence); raises ``MeshError`` (one line)
        for a length the layout cannot split."""
        if self.view is None or self.view.sp_size == 1:
            return None
        if seqlen not in self._layouts:
            self._layouts[seqlen] = self.view.shape.layout(
                seqlen, kind=self.mtraining.parallel.layout, block_size=self.mtraining.sparse_attention.block_size,
                stripe=self.mtraining.effective_stripe_size,
            )  # fmt: skip
        return self._layouts[seqlen]

    def __call__(self, features: list[Any]) -> dict[str, Any]:
        collated = self.collate(features)
        tokens = collated.get("input_ids") if isinstance(collated, Mapping) else None
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            got = type(collated).__name__ if tokens is None else f"input_ids of shape {tuple(tokens.shape)}"
            raise ValueError(
                f"the data collator gave {got}; MTrainingTrainer needs a mapping with input_ids [batch, tokens] "
                "(e.g. rows of equal length through default_data_collator, or DataCollatorWithFlattening)"
            )
        tokens = tokens.long()
        labels = collated.get("labels")
        mask = collated.get("attention_mask")
        if mask is not None:
            mask = mask.bool()
            # Right padding only: every row's mask is ones, then zeros (a running minimum changes nothing).
            if not torch.equal(mask, mask.int().cummin(dim=1).values.bool()):
                raise ValueError(
                    "attention_mask pads inside or before a row's tokens; the sparse attention is causal over whole "
                    "rows: pad on the right (tokenizer padding_side='right') or pack rows without padding"
                )
            if not mask.all():
                labels = (tokens if labels is None else labels).masked_fill(~mask, IGNORE)
        documents = None
        if self.mtraining.data.document_masking and collated.get("position_ids") is not None:
            from ..sparse.documents import Documents

            # Each token's document start is an id that changes exactly where a document starts.
            documents = Documents.from_position_ids(collated["position_ids"].long()).starts
        layout = self.layout(tokens.shape[1])  # make_batch keeps whole rows on one rank a sequence
        batch = make_batch(
            tokens, mesh=self.view, layout=layout, pad_id=self.pad_id, documents=documents, labels=labels
        )
        return {"input_ids": batch.input_ids, "labels": batch.labels, BATCH_KEY: batch}


class MTrainingMixin:
    """The sparse attention and the mesh in a ``transformers.Trainer`` subclass: put it first,
    ``class MySFTTrainer(MTrainingMixin, SFTTrainer)``. The arguments are the base class's; ``args.deepspeed`` must
    name a DeepSpeed JSON (or dict) with an ``"mtraining"`` section, and the model must run
    ``attn_implementation="mtraining"``.

    Attributes:
        mesh: the process groups (a plain ``python`` run joins a process group of one).
        plan: the checked inputs (:class:`TrainerPlan`).
        attentions: sequence length -> the attention handle of that length's batches (its ``stats`` hold the
            latest forward's per-layer statistics).
    """

    def __init__(self, *args: Any, seqlen: int | None = None, **kwargs: Any) -> None:
        """The base class's arguments, and ``seqlen``: the tokens of a training sequence (default the arguments'
        ``max_length``, TRL's ``SFTConfig``), for the start-up GPU memory plan that decides ``"auto"`` of
        ``keep_attention`` and ``tiled_mlp.tokens_per_tile`` as the job does (:func:`plan_trainer`)."""
        import logging

        import deepspeed

        from ..notices import quiet_library_notices
        from ..parallel.comm import set_timeout
        from ..training.distributed import init_distributed

        super().__init__(*args, **kwargs)  # the process group exists after it (TrainingArguments' device set-up)
        deepspeed.utils.logger.setLevel(logging.WARNING)  # its INFO lines (config dumps) are not the run's output
        quiet_library_notices()
        targs = self.args
        if self.compute_loss_func is not None:
            raise ValueError(
                "MTrainingTrainer computes the loss itself (tiled, over the sequence shards); drop compute_loss_func"
            )
        # transformers 5.25 renamed the argument (the old name still sets it): either one asks for its checkpointing.
        if getattr(targs, "activation_checkpointing", False) or getattr(targs, "gradient_checkpointing", False):
            raise ValueError(
                "TrainingArguments(activation_checkpointing=True) (or gradient_checkpointing, TRL's default) "
                "re-estimates every index in the backward; set it False and choose the checkpointed layers with "
                '"mtraining": {"activation_checkpointing": {"layers": ...}}'
            )
        parallelism = getattr(self.accelerator, "parallelism_config", None)
        if parallelism is not None and getattr(parallelism, "sp_size", 1) > 1:
            raise ValueError(
                "parallelism_config sets Accelerate's own sequence parallelism (DeepSpeed ALST); drop it and set the "
                'degrees in the DeepSpeed JSON\'s "mtraining": {"parallel": ...} section'
            )
        local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
        seqlen = getattr(targs, "max_length", None) if seqlen is None else seqlen
        filled = getattr(getattr(targs, "hf_deepspeed_config", None), "config", None)
        self.plan = plan_trainer(
            targs.deepspeed, self.model, world=targs.world_size, local_world=int(local) if local else None,
            seqlen=seqlen, micro_batch=targs.per_device_train_batch_size, filled=filled,
        )  # fmt: skip
        if self.plan.notes and self.is_world_process_zero():
            print("\n".join(self.plan.notes), flush=True)  # as the job prints its plan's lines
        parallel = self.plan.mtraining.parallel
        set_timeout(parallel.timeout_s)
        # A plain `python script.py` has no process group yet (DeepSpeed would look for MPI): a world of one.
        init_distributed(parallel.timeout_s, parallel.rendezvous_timeout_s)
        self.mesh = Mesh(self.plan.shape, timeout_s=parallel.timeout_s)
        self._prepare_model()
        view = self.mesh.coordinates
        pad_id = getattr(self.model.config, "pad_token_id", None)
        self.data_collator = MeshCollator(
            self.data_collator or default_data_collator, self.plan.mtraining, view, 0 if pad_id is None else pad_id
        )
        self.attentions: dict[int, MTrainingAttention] = {}
        # The loss is a share of each sequence's token mean: not normalised by num_items_in_batch, so the Trainer
        # divides it by the accumulation steps (as DeepSpeed's own engine.backward does in the job).
        self.model_accepts_loss_kwargs = False
        self.loss_is_scaled_for_ga = False
        self._stats_sum: torch.Tensor | None = None
        self._stats_count = 0
        self._over_mesh = False

    def _prepare_model(self) -> None:
        """Activation checkpointing (reusing each layer's index) and the tiled MLP on the model, as the job sets
        them up before its engine, with the values the memory plan decided (:func:`plan_trainer`)."""
        from .checkpoint_offload import CheckpointOffload
        from .recompute import enable_activation_checkpointing
        from .tiled_mlp import enable_tiled_mlp

        mtraining = self.plan.mtraining
        checkpointing = mtraining.activation_checkpointing
        if checkpointing.every is not None:
            offload = None
            if self.plan.cpu_checkpointing:
                from deepspeed.accelerator import get_accelerator

                offload = CheckpointOffload(get_accelerator().current_device_name())  # as the job names the card
            enable_activation_checkpointing(
                self.model, keep_attention=checkpointing.keep_attention, every=checkpointing.every, offload=offload
            )
        tile = mtraining.tiled_mlp.tokens_per_tile
        if tile is not None:
            enable_tiled_mlp(self.model, tile)
        self.model.config.use_cache = False

    # ---- the engine over the mesh --------------------------------------------------------------------------

    @contextlib.contextmanager
    def _engine_over_mesh(self) -> Iterator[None]:
        """While inside, ``deepspeed.initialize`` builds its engine over :attr:`mesh` (see the module docstring):
        ``mpu=MeshMPU(mesh)``, ``train_batch_size`` of the data-parallel degree, ZeRO-3's weights gathered for
        ``save_model`` unless the JSON says otherwise, and the sequence-parallel gradient sum."""
        import deepspeed

        if self._over_mesh:  # evaluate() inside train() is inside already
            yield
            return
        original = deepspeed.initialize
        mesh = self.mesh

        @functools.wraps(original)
        def initialize(*args: Any, **kwargs: Any):
            from .deepspeed import MeshMPU, normalize_cuda_arch_list, sum_sequence_parallel_gradients

            if kwargs.get("mpu") is not None:
                raise ValueError(
                    "Accelerate passed its own mpu (DeepSpeed ALST, parallelism_config); drop parallelism_config: "
                    'the mesh comes from the "mtraining" section'
                )
            config = kwargs.get("config_params", kwargs.get("config"))
            if isinstance(config, dict):
                _fit_config(config, mesh.shape.dp)
            kwargs["mpu"] = MeshMPU(mesh)
            normalize_cuda_arch_list()  # before DeepSpeed JIT-builds FusedAdam (a config without CPU offload)
            result = original(*args, **kwargs)
            sum_sequence_parallel_gradients(result[0])
            return result

        deepspeed.initialize, self._over_mesh = initialize, True
        try:
            yield
        finally:
            deepspeed.initialize, self._over_mesh = original, False

    def train(self, *args: Any, **kwargs: Any):
        """``Trainer.train`` with the engine built over the mesh."""
        with self._engine_over_mesh():
            return super().train(*args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """``Trainer.evaluate`` with the engine built over the mesh (the loss only: no logits exist)."""
        with self._engine_over_mesh():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any):
        """``Trainer.predict`` with the engine built over the mesh (the loss only: no logits exist)."""
        with self._engine_over_mesh():
            return super().predict(*args, **kwargs)

    # ---- data -----------------------------------------------------------------------------------------------

    def get_train_dataloader(self):
        """The Trainer's loader, sharded over the data-parallel ranks only."""
        return self._over_data_parallel(super().get_train_dataloader())

    def get_eval_dataloader(self, *args: Any, **kwargs: Any):
        """The Trainer's loader, sharded over the data-parallel ranks only."""
        return self._over_data_parallel(super().get_eval_dataloader(*args, **kwargs))

    def get_test_dataloader(self, *args: Any, **kwargs: Any):
        """The Trainer's loader, sharded over the data-parallel ranks only."""
        return self._over_data_parallel(super().get_test_dataloader(*args, **kwargs))

    def _over_data_parallel(self, loader):
        """``loader`` as Accelerate prepared it (a shard of the rows per process), re-pointed at this rank's
        data-parallel index of ``dp``: the ranks of a sequence group read the same rows. The shard's attributes are
        read at each iteration (transformers re-points a ``BatchRebalanceSampler``'s wrapper the same way)."""
        from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard

        if self.plan.shape.sp == 1:
            return loader
        dp, index = self.plan.shape.dp, self.mesh.dp_index
        if isinstance(loader, DataLoaderDispatcher):
            raise ValueError(
                "an iterable dataset dispatched from rank 0 (Accelerate's dispatch_batches) cannot give the ranks of "
                "a sequence group the same rows; pass TrainingArguments(accelerator_config={'dispatch_batches': "
                "False}) or a map-style dataset"
            )
        shards = [s for s in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None),
                              getattr(loader, "dataset", None))
                  if isinstance(s, BatchSamplerShard | IterableDatasetShard)]  # fmt: skip
        for shard in shards:
            shard.num_processes, shard.process_index = dp, index
        if not shards and self.args.world_size > 1:
            raise ValueError(
                f"the data loader ({type(loader).__name__}) has no Accelerate shard to point at data-parallel rank "
                f"{index} of {dp}; build it through the Trainer (get_train_dataloader)"
            )
        return loader

    def get_total_train_batch_size(self, args) -> int:
        """Sequences per optimizer step: micro-batch x accumulation x the data-parallel degree (not the world)."""
        return self._train_batch_size * args.gradient_accumulation_steps * self.plan.shape.dp

    # ---- the loss -------------------------------------------------------------------------------------------

    def attention(self, batch: Batch) -> MTrainingAttention:
        """The attention handle of ``batch``'s sequence length (built on first use: its context and estimator
        graphs are per length)."""
        seqlen = batch.layout.seqlen if batch.layout is not None else batch.input_ids.shape[1]
        if seqlen not in self.attentions:
            mtraining = self.plan.mtraining
            self.attentions[seqlen] = MTrainingAttention(
                mtraining.sparse_attention, mesh=self.mesh, layout=batch.layout,
                ring_columns=mtraining.parallel.ring_columns, packed=mtraining.data.document_masking,
            )  # fmt: skip
        return self.attentions[seqlen]

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        """This rank's share of the batch's token-mean loss (``integration.loss.forward_loss``): its gradient is
        this rank's part, which DeepSpeed sums over the sequence ranks; its value is the whole sequence's (the
        shares summed over the sequence group, as ``deepspeed_sp_compute_loss`` reports ALST's), so the Trainer
        logs and evaluates the sequence loss. ``outputs`` hold the loss only: no logits are made."""
        from .loss import forward_loss

        batch = inputs.get(BATCH_KEY)
        if batch is None:
            raise ValueError(
                f"the batch has no {BATCH_KEY!r}: MTrainingTrainer's data collator (MeshCollator) was replaced; "
                "pass your collator as data_collator= and the Trainer wraps it"
            )
        attention = self.attention(batch)
        loss = forward_loss(model, batch, attention, fused=self.plan.fused)
        layers = sorted(attention.stats)
        stats = [attention.stats[i].density.to(loss.device, torch.float32) for i in layers]
        stats += [attention.stats[i].recall.to(loss.device, torch.float32) for i in layers]
        reduced = torch.stack([loss.detach().float(), *stats])
        if self.plan.shape.sp > 1:
            dist.all_reduce(reduced, group=self.mesh.sp)  # one collective: the loss shares and the statistics
            reduced[1:] /= self.plan.shape.sp
            loss = loss + (reduced[0].to(loss.dtype) - loss.detach())
        if model.training:
            per_layer = reduced[1:].detach()
            self._stats_sum = per_layer if self._stats_sum is None else self._stats_sum + per_layer
            self._stats_count += 1
        return (loss, {"loss": loss.detach()}) if return_outputs else loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, a training one (with ``loss``) with the attention's statistics since the previous log:
        ``attention_density`` and ``attention_recall`` (means over the sparse layers and the micro-batches, over
        this rank's sequence group), and on a ring ``ring_imbalance`` of the latest forward."""
        from .budget import sparse_mean

        if "loss" in logs and self._stats_sum is not None:
            n = self._stats_sum.numel() // 2
            means = (self._stats_sum / self._stats_count).tolist()
            sparse = self.plan.mtraining.sparse_attention
            logs = {**logs, "attention_density": sparse_mean(means[:n], sparse),
                    "attention_recall": sparse_mean(means[n:], sparse)}  # fmt: skip
            latest = next(reversed(self.attentions.values()), None)
            if self.plan.shape.ring > 1 and latest is not None and latest.stats:
                imbalance = [float(latest.stats[i].imbalance) for i in sorted(latest.stats)]
                logs["ring_imbalance"] = sparse_mean(imbalance, sparse)
            self._stats_sum, self._stats_count = None, 0
        super().log(logs, *args, **kwargs)


def trainer_arguments(ds_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``TrainingArguments`` keyword arguments a DeepSpeed config fixes, so that transformers' check of the two
    against each other (``HfTrainerDeepSpeedConfig``: a value written in the JSON must equal the argument's) passes:
    micro-batch, accumulation, clipping, AdamW's settings, bf16, and the scheduler's warm-up; without a
    ``"scheduler"`` section a constant learning rate, as DeepSpeed (and the job) runs it, where the Trainer would
    otherwise decay it linearly. Take ``ds_config`` with its ``"auto"`` values decided
    (``ds_mtraining.deepspeed_config(path, steps)``, as the training job decides them); an ``"auto"`` left in it is
    left to the Trainer (nothing is returned for it)."""

    def given(value: Any) -> bool:
        return value is not None and value != "auto"

    out: dict[str, Any] = {}
    pairs = (
        ("per_device_train_batch_size", ds_config.get("train_micro_batch_size_per_gpu")),
        ("gradient_accumulation_steps", ds_config.get("gradient_accumulation_steps")),
        ("max_grad_norm", ds_config.get("gradient_clipping")),
        ("bf16", ds_config.get("bf16", {}).get("enabled")),
        ("fp16", ds_config.get("fp16", {}).get("enabled")),
    )
    params = ds_config.get("optimizer", {}).get("params", {})
    betas = params.get("betas")
    pairs += (
        ("learning_rate", params.get("lr")),
        ("adam_epsilon", params.get("eps")),
        ("weight_decay", params.get("weight_decay")),
        ("adam_beta1", betas[0] if isinstance(betas, list | tuple) else None),
        ("adam_beta2", betas[1] if isinstance(betas, list | tuple) else None),
        ("warmup_steps", ds_config.get("scheduler", {}).get("params", {}).get("warmup_num_steps")),
    )
    out.update((key, value) for key, value in pairs if given(value))
    if "scheduler" not in ds_config:
        out["lr_scheduler_type"] = "constant"
    return out


def _fit_config(config: dict[str, Any], dp: int) -> None:
    """The DeepSpeed config Accelerate hands ``deepspeed.initialize``, for an engine over the mesh: its batch size
    counts the data-parallel ranks only (``train_batch_size`` = micro-batch x accumulation x DP, as
    ``MeshMPU.get_data_parallel_world_size`` tells DeepSpeed), and under ZeRO-3 the weights are gathered for
    ``save_model`` unless the JSON decides (Accelerate's ``get_state_dict`` reads the same dict)."""
    if "train_batch_size" in config:
        micro = int(config.get("train_micro_batch_size_per_gpu", 1))
        config["train_batch_size"] = micro * int(config.get("gradient_accumulation_steps", 1)) * dp
    zero = config.get("zero_optimization", {})
    if zero.get("stage") == 3:
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)


class MTrainingTrainer(MTrainingMixin, Trainer):
    """``transformers.Trainer`` with the sparse attention and the mesh of the DeepSpeed JSON's ``"mtraining"``
    section (:class:`MTrainingMixin`); it takes the same arguments."""
