"""Our settings, read from the ``"mtraining"`` section of a DeepSpeed JSON config.

DeepSpeed ignores top-level keys it does not know, so the section lives next to DeepSpeed's own settings
and validates itself here (strict: unknown keys, wrong types and out-of-range values are errors)::

    {
      "train_micro_batch_size_per_gpu": 1,
      "zero_optimization": {"stage": 2},
      "mtraining": {
        "sparse_attention": {
          "pattern": "vertical_slash", "block_size": 64, "sink_tokens": 4, "local_blocks": 1,
          "estimator": {"strategy": "spread", "rows": 128, "recall": 0.98, "max_columns": 4096, "max_offsets": 1024},
          "overrides": [{"layers": [0], "pattern": "dense"}]
        },
        "parallel": {"sequence_parallel_size": 8, "ulysses_degree": 2, "ring_degree": 4, "layout": "striped"},
        "activation_checkpointing": {"layers": "all", "keep_attention": "auto"},
        "tiled_mlp": {"tokens_per_tile": null},
        "fused_kernels": {"enabled": "auto"},
        "data": {"document_masking": false}
      }
    }

Every key is optional; a missing one takes its default. Load it with
``MTrainingConfig.from_deepspeed_config("ds_configs/zero2.json")``; problems raise ``ConfigError`` listing each
bad key as ``mtraining.<dotted.key> = <value>: <what is wrong>``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

__all__ = [
    "ESTIMATOR_CONFIGS",
    "ActivationCheckpointingConfig",
    "BaselineEstimator",
    "ConfigError",
    "DataConfig",
    "EstimatorConfig",
    "FusedKernelsConfig",
    "LayerOverride",
    "MTrainingConfig",
    "MissingSectionError",
    "ParallelConfig",
    "Pattern",
    "SparseAttentionConfig",
    "SpreadEstimator",
    "StrictModel",
    "TiledMLPConfig",
]

SECTION = "mtraining"
"""Top-level key of our section in a DeepSpeed config."""

Pattern = Literal["vertical_slash", "dense"]
"""Attention of a layer: estimated vertical-slash sparse, or dense causal."""

_Recall = Annotated[float, Field(gt=0, le=1)]
_NonNegative = Annotated[int, Field(ge=0)]
_Positive = Annotated[int, Field(ge=1)]

MAX_BUDGET_TOKENS = 2**20
"""Upper bound of every token-counted sparse setting (columns, diagonals, rows, sinks, exclusion band): a budget
counts positions of one sequence, and 2**20 = 1048576 tokens is more than one training step holds (a 1M-token
sequence already spans many GPUs of sequence parallelism). Past it a value is a typo, and past 2**63 it would
overflow the index's int64 sizes in the middle of a forward."""
MAX_BUDGET_BLOCKS = MAX_BUDGET_TOKENS // 64
"""Upper bound of block-counted settings (``local_blocks``): ``MAX_BUDGET_TOKENS`` in blocks of the smallest size."""


def _at_most(bound: int, unit: str):
    def check(value: int) -> int:
        if value > bound:
            raise ValueError(
                f"at most {bound} {unit} (2**{bound.bit_length() - 1}, past the longest sequence this job is sized for: "
                f"a budget counts {unit} of one sequence); use at most the sequence length in {unit}"
            )
        return value

    return AfterValidator(check)


_Tokens = Annotated[int, Field(ge=0), _at_most(MAX_BUDGET_TOKENS, "tokens")]
_PositiveTokens = Annotated[int, Field(ge=1), _at_most(MAX_BUDGET_TOKENS, "tokens")]
_Blocks = Annotated[int, Field(ge=1), _at_most(MAX_BUDGET_BLOCKS, "blocks")]
_Ratio = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]

_EXAMPLE_SECTION = """\
"mtraining": {
  "sparse_attention": {"pattern": "vertical_slash", "block_size": 64},
  "parallel": {"sequence_parallel_size": 1, "ulysses_degree": 1, "ring_degree": 1}
}"""


class ConfigError(ValueError):
    """The ``"mtraining"`` section (or the file holding it) is invalid; the message says where and why."""


class MissingSectionError(ConfigError):
    """The DeepSpeed config has no ``"mtraining"`` section (callers with their own example of one catch this)."""


class StrictModel(BaseModel):
    """Base of our config models: unknown keys are errors, instances are immutable, defaults are validated.

    Strict types, so ``"64"`` is not silently read as ``64`` (tuple fields opt out so JSON arrays still load).
    """

    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, strict=True, use_attribute_docstrings=True
    )


class BaselineEstimator(StrictModel):
    """The authors' online budget approximation (``ds_mtraining.estimator.baseline``): the last ``last_q`` queries
    are observed, and each family is filled to its own recall, on its own."""

    strategy: Literal["baseline"] = "baseline"
    """Selects this strategy."""
    last_q: _PositiveTokens = 64
    """Observation rows: the last ``last_q`` queries of the global sequence."""
    column_recall: _Recall = 0.9
    """Share of the observed attention mass the chosen key columns must reach, in (0, 1]."""
    diagonal_recall: _Recall = 0.9
    """Share of the observed attention mass the chosen token diagonals must reach, in (0, 1]."""
    min_columns: _Tokens = 0
    """Fewest key columns chosen, sinks not counted."""
    max_columns: _Tokens = 1024
    """Most key columns chosen, sinks not counted."""
    min_diagonals: _Tokens = 0
    """Fewest token diagonals chosen (each then becomes the one or two block offsets it crosses)."""
    max_diagonals: _Tokens = 1024
    """Most token diagonals chosen."""

    @model_validator(mode="after")
    def _check(self) -> BaselineEstimator:
        for kind in ("columns", "diagonals"):
            low, high = getattr(self, f"min_{kind}"), getattr(self, f"max_{kind}")
            if low > high:
                raise ValueError(f"min_{kind}={low} > max_{kind}={high}; raise max_{kind} or lower min_{kind}")
        return self

    def describe(self) -> str:
        """The settings as the job's start-up print shows them."""
        return (
            f"estimator=baseline last_q={self.last_q} recall columns={self.column_recall} "
            f"diagonals={self.diagonal_recall} columns [{self.min_columns}, {self.max_columns}] "
            f"diagonals [{self.min_diagonals}, {self.max_diagonals}]"
        )


class SpreadEstimator(StrictModel):
    """Rows spread over the whole sequence and a cost-aware greedy over both families
    (``ds_mtraining.estimator.spread``)."""

    strategy: Literal["spread"] = "spread"
    """Selects this strategy."""
    rows: _PositiveTokens = 128
    """Observation rows, one per equal segment of the sequence."""
    recall: _Recall = 0.98
    """Stop adding entries once the observation rows' covered mass reaches this share (0.98 keeps SmolLM2-135M's
    perplexity within ~1.2 % of dense at 2K-8K; 0.9 costs ~11 %)."""
    max_columns: _Tokens = 4096
    """Most key columns the greedy chooses, sinks not counted. The diffuse heads of a context-extended model want
    2-6K columns at recall 0.98: a 2048 cap costs 1.11x the oracle's density, 4096 costs 1.08x (SmolLM2 at 16K and
    32K). A lower cap bounds the estimate's worst case (heads that run every round to the cap)."""
    max_offsets: _Tokens = 1024
    """Most block offsets the greedy chooses beyond the ``local_blocks`` forced ones."""
    min_ratio: _Ratio = 0.0
    """Never add a column or offset whose new entries' estimated mean probability is below this (e.g. 2e-4; 0 = no
    floor): trades a little recall on weak heads for density."""
    exclusion: _Tokens = 256
    """Attention within this many tokens of its row is not evidence for a column (it belongs to the local band)."""
    tail_rows: _Tokens = 32
    """The last queries (where a prompt's question sits) are observed after the greedy, and columns are added for
    what they read outside the index (a needle only the question reads); 0 = off."""
    tail_columns: _Tokens = 64
    """Most columns added for the tail rows, by their attention mass outside the index, until their covered mass
    reaches ``recall`` (on top of ``max_columns``)."""

    def describe(self) -> str:
        """The settings as the job's start-up print shows them."""
        return (
            f"estimator=spread rows={self.rows} recall={self.recall} columns<={self.max_columns} "
            f"offsets<={self.max_offsets} min_ratio={self.min_ratio} exclusion={self.exclusion} "
            f"tail_rows={self.tail_rows} tail_columns<={self.tail_columns}"
        )


EstimatorConfig = Annotated[BaselineEstimator | SpreadEstimator, Field(discriminator="strategy")]
"""One estimation strategy's settings, chosen by ``"strategy"``; a new strategy adds its model here and to
``ESTIMATOR_CONFIGS``."""

ESTIMATOR_CONFIGS: dict[str, type[BaselineEstimator | SpreadEstimator]] = {
    "baseline": BaselineEstimator,
    "spread": SpreadEstimator,
}
"""The strategies' config models by name (their defaults: ``ESTIMATOR_CONFIGS[name]()``)."""

_FLAT_KEYS = {
    "last_q": "baseline.last_q", "vertical_recall": "baseline.column_recall",
    "slash_recall": "baseline.diagonal_recall", "vertical_min": "baseline.min_columns",
    "slash_min": "baseline.min_diagonals", "vertical_max": "spread.max_columns or baseline.max_columns",
    "slash_max": "spread.max_offsets or baseline.max_diagonals", "spread_rows": "spread.rows",
    "spread_recall": "spread.recall", "spread_min_ratio": "spread.min_ratio", "spread_exclusion": "spread.exclusion",
    "spread_tail_rows": "spread.tail_rows", "spread_tail_columns": "spread.tail_columns",
}  # fmt: skip
"""The flat keys of the first releases, by where they live now (``<strategy>.<key>`` inside ``"estimator"``)."""


_OVERRIDE_DOC = """Sparse-attention settings for some layers: ``layers`` and any per-layer key of ``sparse_attention``
(all but ``block_size``); a key left out inherits the base value. Built from :class:`SparseAttentionConfig`'s
fields, so the two cannot drift apart."""


def _refuse_old_layout(data: Any, *, strategy_required: bool) -> None:
    """The first releases' layout (flat keys, ``"estimator": "spread"``) gets a line saying where each key went,
    not only "unknown key"; a base estimator object must name its strategy (an override's may leave it out)."""
    if not isinstance(data, Mapping):
        return
    example = '"estimator": {"strategy": "spread", "recall": 0.98, "max_columns": 1024}'
    estimator = data.get("estimator")
    if strategy_required and isinstance(estimator, Mapping) and "strategy" not in estimator:
        raise ValueError(
            f'estimator needs its "strategy": one of {", ".join(ESTIMATOR_CONFIGS)}, e.g. "estimator": '
            '{"strategy": "spread", "recall": 0.98}'
        )
    moved = [f'"{key}" is now estimator {_FLAT_KEYS[key]}' for key in data if key in _FLAT_KEYS]
    if isinstance(estimator, str):
        moved.append(f'"estimator": "{estimator}" is now an object naming its "strategy"')
    if moved:
        raise ValueError(f"{'; '.join(moved)} (e.g. {example})")


class SparseAttentionConfig(StrictModel):
    """Vertical-slash sparse attention: index granularity, forced entries, the estimator, per-layer overrides."""

    pattern: Pattern = "vertical_slash"
    """``"vertical_slash"``: estimate a sparse index every forward; ``"dense"``: full causal attention."""
    block_size: Literal[64, 128] = 64
    """Tile size (tokens) of the index and the kernels; slash offsets are in blocks of this size."""
    sink_tokens: _Tokens = 4
    """Key positions ``0 .. sink_tokens-1`` are always in the vertical set (the estimators find other strong
    columns themselves; every forced column costs ``N`` entries, 1.6 % density per 64 sinks at 8K)."""
    local_blocks: _Blocks = 1
    """Block offsets ``0 .. local_blocks-1`` are always in the slash set (offset 0 is always kept)."""
    estimator: EstimatorConfig = SpreadEstimator()
    """The strategy that turns the observation rows' attention into an index, with its settings and budget caps:
    ``{"strategy": "spread", ...}`` (the default) or ``{"strategy": "baseline", ...}``."""
    overrides: tuple[LayerOverride, ...] = Field((), strict=False)
    """Per-layer changes, e.g. ``[{"layers": [0], "pattern": "dense"}]`` keeps layer 0 dense."""

    @model_validator(mode="before")
    @classmethod
    def _flat_keys(cls, data: Any) -> Any:
        _refuse_old_layout(data, strategy_required=True)
        return data

    @model_validator(mode="after")
    def _check(self) -> SparseAttentionConfig:
        owner: dict[int, int] = {}
        for i, override in enumerate(self.overrides):
            for layer in override.layers:
                if layer in owner:
                    raise ValueError(
                        f"layer {layer} is listed in overrides[{owner[layer]}] and overrides[{i}]; "
                        "list each layer in one override only"
                    )
                owner[layer] = i
            # Validated merged so that an override clashing with the base fails at load time, not mid-training.
            try:
                self.for_layer(override.layers[0])
            except ValidationError as e:
                reasons = "; ".join(
                    f"{'.'.join(_written(err['loc']))}: {err['msg'].removeprefix('Value error, ')}"
                    for err in e.errors(include_url=False)
                )
                raise ValueError(f"overrides[{i}] (layers {list(override.layers)}) merged with the base: {reasons}")
        return self

    def describe(self) -> str:
        """The settings (of one layer: ``for_layer`` applied) as the job's start-up print shows them."""
        if self.pattern == "dense":
            return "dense causal attention"
        return (
            f"vertical_slash bs={self.block_size} sinks={self.sink_tokens} local_blocks={self.local_blocks} "
            f"{self.estimator.describe()}"
        )

    def check_layers(self, num_layers: int, model: str, source: str = "") -> None:
        """Every override names a layer of ``model`` (``num_layers`` decoder layers): an override of a layer the
        model does not have would silently apply to nothing, so it is a :class:`ConfigError` naming the layer."""
        for i, override in enumerate(self.overrides):
            missing = [layer for layer in override.layers if layer >= num_layers]
            if missing:
                raise ConfigError(
                    f"{source}{': ' if source else ''}mtraining.sparse_attention.overrides[{i}] names layer{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(map(str, missing))}, but {model} has {num_layers} layers (0..{num_layers - 1}); "
                    "list only layers the model has"
                )

    @classmethod
    def shipped(cls) -> SparseAttentionConfig:
        """The settings of the shipped training configs (``ds_configs/``): the defaults with layer 0 dense (sparse,
        it kept 0.74-0.83 of its attention mass on SmolLM2). What an evaluation uses when given no config."""
        return cls(overrides=[{"layers": [0], "pattern": "dense"}])

    def layer0_note(self) -> str | None:
        """A note when layer 0 attends sparsely: the shipped configs keep it dense with an override, and a user's
        ``overrides`` list replaces that list as a whole, so dropping the entry makes layer 0 sparse without a word."""
        if self.for_layer(0).pattern == "dense":
            return None
        return (
            "note: layer 0 attends sparsely: no entry of mtraining.sparse_attention.overrides keeps it dense (the "
            'shipped configs do, and an "overrides" list replaces theirs as a whole); add {"layers": [0], '
            '"pattern": "dense"} to it if layer 0 should stay dense'
        )

    def for_layer(self, layer: int) -> SparseAttentionConfig:
        """Settings for ``layer``: the base with the override listing ``layer`` applied, and ``overrides=()``.

        An override's ``estimator`` naming the base's strategy changes only the keys it sets; one naming another
        strategy replaces the estimator (that strategy's defaults for the keys it leaves out). The result is
        validated, so a merge that breaks a rule (``min_columns > max_columns``) raises ``ValidationError``.
        """
        if layer < 0:
            raise ValueError(f"layer must be >= 0, got {layer}")
        merged = self.model_dump(exclude={"overrides"})
        override = next((o for o in self.overrides if layer in o.layers), None)
        if override is not None:
            # An explicit null inherits, like a key left out.
            changes = override.model_dump(include=override.model_fields_set - {"layers"}, exclude_none=True)
            estimator = changes.pop("estimator", None)
            if estimator is not None:
                same = estimator.get("strategy", merged["estimator"]["strategy"]) == merged["estimator"]["strategy"]
                merged["estimator"] = merged["estimator"] | estimator if same else estimator
            merged |= changes
        return type(self).model_validate(merged)


def _override_model() -> type[StrictModel]:
    """``LayerOverride``: ``layers`` plus every per-layer field of :class:`SparseAttentionConfig`, each optional (an
    unset one inherits the base value) and validated by the same rules; the estimator's keys may be a subset."""
    fields: dict[str, Any] = {
        "layers": (
            tuple[_NonNegative, ...],
            Field(min_length=1, strict=False, description="Layer indices (0-based) this override applies to; each "
                  "layer may appear in one override only."),
        )
    }  # fmt: skip
    for name, info in SparseAttentionConfig.model_fields.items():
        if name in ("overrides", "block_size"):  # one block size for the whole model: the kernels share it
            continue
        annotation = _EstimatorOverride if name == "estimator" else info.rebuild_annotation()
        fields[name] = (annotation | None, Field(None, description=f"Overrides ``{name}``."))
    return create_model(
        "LayerOverride",
        __base__=StrictModel,
        __doc__=_OVERRIDE_DOC,
        __validators__={
            "_distinct_layers": field_validator("layers")(_distinct_layers),
            "_flat_keys": model_validator(mode="before")(_override_flat_keys),
        },
        **fields,
    )


def _override_flat_keys(cls: type, data: Any) -> Any:
    _refuse_old_layout(data, strategy_required=False)
    return data


def _distinct_layers(cls: type, layers: tuple[int, ...]) -> tuple[int, ...]:
    repeated = sorted({layer for layer in layers if layers.count(layer) > 1})
    if repeated:
        raise ValueError(f"layers {repeated} listed more than once; list each layer once")
    return layers


_EstimatorOverride = dict[str, Any]
"""An override's ``estimator``: any of a strategy's keys; validated merged with the base (``for_layer``)."""
LayerOverride = _override_model()
SparseAttentionConfig.model_rebuild()


class ParallelConfig(StrictModel):
    """Sequence (context) parallelism: Ulysses x ring degrees, token layout, hierarchical ring."""

    plan: Literal["explicit", "auto"] = "explicit"
    """``"explicit"``: the degrees and keys below as written (or their defaults). ``"auto"``: at start-up the cluster
    simulator (``sim.report.rank_plans``, the committed step costs, a planted 5 % pattern) picks, for the launched world
    and node size on ``topology``, the fastest shape among those the keys written here allow: Ulysses and ring degrees,
    inner ring, ``kv_exchange`` and layout (``sequence_parallel_size``, when not written, is the whole world); a key
    written keeps its value. The banner gives the choice with its predicted attention time per layer and the runner-up,
    and the log the measured step beside the predicted one after the first steps (``training.auto_plan``)."""
    topology: Literal["h100", "h200", "a100"] = "h100"
    """The node ``plan: "auto"`` prices: a preset of ``sim.PRESETS`` (GPUs a node, NVLink and inter-node bandwidth,
    card memory); the launch's own ``LOCAL_WORLD_SIZE`` replaces its GPUs a node."""
    sequence_parallel_size: _Positive = 1
    """Ranks that share one sequence; must equal ``ulysses_degree * ring_degree``."""
    ulysses_degree: _Positive = 1
    """Ranks of one Ulysses all-to-all group (sequence gathered, heads scattered); best inside a node."""
    ring_degree: _Positive = 1
    """Ranks of one attention ring (KV shards passed around)."""
    layout: Literal["contiguous", "zigzag", "striped"] = "striped"
    """Token order over ring ranks: contiguous chunks, zigzag chunk pairs, or block-striped (balanced sparse)."""
    stripe_size: _Positive | None = None
    """Tokens per stripe of the striped layout; ``None`` uses the sparse block size."""
    inner_ring_size: _Positive | None = None
    """Hierarchical ring: ranks per inner (intra-node) ring, dividing ``ring_degree``; ``None`` is a flat ring."""
    kv_exchange: Literal["ring", "all_gather"] = "ring"
    """How K/V shards move inside an inner ring (``inner_ring_size`` ranks; the whole ring when flat): ``"ring"``
    passes them one hop per step (``inner_ring_size`` kernel calls per outer step); ``"all_gather"`` gathers the group's
    shards and attends them in one call, dK/dV reduce-scattered back. A call's fixed cost and query-tile programs are
    then paid once per outer step instead of per rank, for ``inner_ring_size`` shards of K/V held during the call
    (small with GQA); a flat ring with ``"all_gather"`` gathers the whole sequence's K/V, as Llama 3's context
    parallelism does (``parallel.ring``'s docstring)."""
    ring_columns: Literal["per_step", "gathered"] = "per_step"
    """How the ring meets the vertical columns: ``"per_step"`` at the step whose KV shard holds each column (Triton
    on GPU; each step walks only its shard's columns), or ``"gathered"``: their K/V all-reduced once and their work
    spread evenly over the steps, which balances the sink columns' work at large ring degrees but runs as PyTorch
    matmuls (3x slower on 2 H200s, docs/measurements.md). The cluster simulator puts ``"per_step"`` within 3 % of a
    gathered pass as fast as the kernels at 512K on 32 GPUs (benchmarks/results/2026-12-05-sim_clusters.md)."""
    timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 600.0
    """Deadline (seconds) of every collective and point-to-point wait: the mesh's groups (ring sends/receives,
    Ulysses all-to-all, the estimator's all-reduces) and the world group (DeepSpeed's gradient reduction, the
    metrics). A rank that waits longer for a stalled or dead peer ends the job with one ``error:`` line naming
    the operation and the peer (exit status 3) instead of hanging. It must exceed the longest time a rank may
    legitimately wait for the others (a checkpoint save, an uneven first step)."""
    rendezvous_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 30.0
    """Deadline (seconds) for a rank to reach rank 0's rendezvous (``MASTER_ADDR:MASTER_PORT``) at start-up; a master
    that does not resolve or answer ends the job with one ``error:`` line (exit status 3) instead of waiting for
    ``timeout_s``. Raise it where rank 0 starts much later than the others."""

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        u, r, sp = self.ulysses_degree, self.ring_degree, self.sequence_parallel_size
        degrees = {"ulysses_degree", "ring_degree", "sequence_parallel_size"}
        if self.plan == "auto" and not degrees <= self.model_fields_set:
            return self  # the degrees not written are the plan's to choose (training.auto_plan checks the rest)
        if u * r != sp:
            raise ValueError(
                f"ulysses_degree={u} * ring_degree={r} = {u * r} != sequence_parallel_size={sp}; "
                "choose degrees whose product is sequence_parallel_size"
            )
        if self.inner_ring_size is not None and r % self.inner_ring_size:
            divisors = [d for d in range(1, r + 1) if r % d == 0]
            raise ValueError(
                f"inner_ring_size={self.inner_ring_size} does not divide ring_degree={r}; "
                f"use one of {divisors}, or null for a flat ring"
            )
        return self


def _bool_or_auto(value: Any) -> Any:
    """A ``bool | "auto"`` field's value, checked before pydantic tries each member of the union: one message, not
    one per member."""
    if value is True or value is False or value == "auto":
        return value
    raise ValueError('use true, false or "auto"')


class ActivationCheckpointingConfig(StrictModel):
    """Which decoder layers checkpoint, and what their recomputation reuses from the forward (it always reuses
    each sparse layer's index; ``ds_mtraining.integration.recompute``). Where the checkpoints live is DeepSpeed's
    own section: ``"activation_checkpointing": {"cpu_checkpointing": true}`` keeps them in CPU memory."""

    layers: Literal["all", "none"] | _Positive = "all"
    """``"all"``: every decoder layer keeps only its input and recomputes the rest in the backward; ``k``: every
    k-th layer from layer 0 does, the others keep their activations (faster, more memory); ``"none"``: no layer
    recomputes (short sequences where memory allows)."""

    keep_attention: bool | Literal["auto"] = "auto"
    """Also keep each sparse layer's attention output and log-sum-exp from the forward, so the recomputation
    skips the attention kernel: ``B*N*Hq*D`` elements of the activation dtype plus ``B*Hq*N`` fp32 more memory per
    sparse layer until its backward. Dense layers and the ring path (``ring_degree > 1``) recompute as before.
    ``"auto"``: kept where the start-up memory estimate leaves room for it on the GPU (``ds_mtraining.memory``; the
    banner says which), not on a machine without one."""

    _keep_attention_is_bool_or_auto = field_validator("keep_attention", mode="before")(_bool_or_auto)

    @model_validator(mode="after")
    def _kept_attention_needs_a_recomputation(self) -> ActivationCheckpointingConfig:
        if self.keep_attention is True and self.layers == "none":
            raise ValueError(
                'keep_attention saves the recomputation of checkpointed layers, and layers is "none": set '
                'keep_attention false, or checkpoint layers ("all" or every k-th)'
            )
        return self

    @property
    def every(self) -> int | None:
        """Checkpoint every this-many-th decoder layer (1: all), or ``None`` for none."""
        return {"all": 1, "none": None}.get(self.layers, self.layers)


class TiledMLPConfig(StrictModel):
    """Each decoder layer's MLP in tiles of tokens (DeepSpeed's ``TiledMLP``; ``ds_mtraining.integration.tiled_mlp``):
    its activations then exist one tile at a time, for one more MLP forward per step."""

    tokens_per_tile: Annotated[int, Field(ge=1024)] | Literal["auto"] | None = None
    """Tokens per tile (``null``: the MLP untiled). At 512K tokens and intermediate size 11008 an untiled bf16
    activation is 11.5 GB; tiles of 32768 tokens cut it 16-fold. ``"auto"``: untiled where the start-up memory
    estimate fits without tiles, else the largest of 65536, 32768, 16384 and 8192 tokens that fits
    (``ds_mtraining.memory``; the banner says which); untiled on a machine without a GPU."""


class FusedKernelsConfig(StrictModel):
    """Liger Kernel's fused RMSNorm, SwiGLU MLP and RoPE in place of transformers' own, for the Llama, Qwen2, Qwen3
    and Mistral families (``ds_mtraining.integration.fused_kernels``)."""

    enabled: bool | Literal["auto"] = "auto"
    """``"auto"``: on where a GPU is present and the model's family is supported, off otherwise (the start-up
    banner says which and why); ``true``: on, and an error at start-up where they cannot run (no GPU, another model
    family); ``false``: transformers' own PyTorch modules."""

    _enabled_is_bool_or_auto = field_validator("enabled", mode="before")(_bool_or_auto)


class DataConfig(StrictModel):
    """How the training rows' packed documents are read (``ds_mtraining.integration.batch``; docs/design.md,
    "Packed documents")."""

    document_masking: bool = False
    """Keep every token inside its document: position ids restart at 0 at each document (RoPE), a document's last
    token (its separator) predicts nothing, and attention never crosses a document boundary. Off (the default), a
    packed row trains as one causal sequence, as long-context pre-training usually does; the document-masked path
    (estimator, kernels, ring) is tested on CPU and gloo but not yet timed on a GPU. Needs packed rows (a model with
    a tokenizer); works with every sequence-parallel layout (the ring and Ulysses take the whole rows' documents)."""


class MTrainingConfig(StrictModel):
    """The ``"mtraining"`` section of a DeepSpeed config."""

    sparse_attention: SparseAttentionConfig = SparseAttentionConfig()
    """Sparse attention pattern, estimator budgets and per-layer overrides."""
    parallel: ParallelConfig = ParallelConfig()
    """Sequence-parallel degrees and token layout."""
    activation_checkpointing: ActivationCheckpointingConfig = ActivationCheckpointingConfig()
    """What the activation checkpointing's recomputation takes from the forward."""
    tiled_mlp: TiledMLPConfig = TiledMLPConfig()
    """Whether the MLPs run in tiles of tokens."""
    fused_kernels: FusedKernelsConfig = FusedKernelsConfig()
    """Whether RMSNorm, the SwiGLU MLP and RoPE run as Liger Kernel's fused Triton kernels."""
    data: DataConfig = DataConfig()
    """Whether attention, positions and labels stay inside each packed document."""

    @model_validator(mode="after")
    def _check(self) -> MTrainingConfig:
        stripe, block = self.effective_stripe_size, self.sparse_attention.block_size
        if stripe % block:
            raise ValueError(
                f"parallel.stripe_size={stripe} is not a multiple of sparse_attention.block_size={block} "
                f"(local tiles must stay whole); use a multiple of {block}, or null for {block}"
            )
        return self

    @property
    def effective_stripe_size(self) -> int:
        """Tokens per stripe of the striped layout: ``parallel.stripe_size``, else ``sparse_attention.block_size``."""
        if self.parallel.stripe_size is None:
            return self.sparse_attention.block_size
        return self.parallel.stripe_size

    @classmethod
    def from_deepspeed_config(cls, config: str | os.PathLike[str] | Mapping[str, Any]) -> MTrainingConfig:
        """Validate the ``"mtraining"`` section of a DeepSpeed config.

        Args:
            config: path to a DeepSpeed JSON file, or the already-loaded config dict.

        Raises:
            FileNotFoundError: the file does not exist.
            ConfigError: invalid JSON (file:line:column), no ``"mtraining"`` section, or invalid values
                (every error listed as ``mtraining.<dotted.key> = <value>: <reason>``).
        """
        if isinstance(config, Mapping):
            source, loaded = "<dict>", config
        else:
            source = os.fspath(config)
            text = Path(source).read_text()
            try:
                loaded = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{source}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
        if not isinstance(loaded, Mapping):
            raise ConfigError(f"{source}: a DeepSpeed config must be a JSON object, got {type(loaded).__name__}")
        if SECTION not in loaded:
            raise MissingSectionError(f'{source} has no "{SECTION}" section; add one, e.g.\n{_EXAMPLE_SECTION}')
        section = loaded[SECTION]
        if not isinstance(section, Mapping):
            raise ConfigError(f'{source}: "{SECTION}" must be an object, got {section!r}; e.g.\n{_EXAMPLE_SECTION}')
        try:
            return cls.model_validate(section)
        except ValidationError as e:
            raise ConfigError(_describe(e, source)) from None


def _describe(error: ValidationError, source: str) -> str:
    """One line per pydantic error, keyed by the dotted path inside the DeepSpeed config."""
    lines = [f'invalid "{SECTION}" section in {source}:']
    for err in error.errors(include_url=False):
        loc = err["loc"]
        key = ".".join([SECTION, *_written(loc)])
        msg = err["msg"].removeprefix("Value error, ")  # pydantic's prefix for our validators' ValueErrors
        if err["type"] == "extra_forbidden":
            allowed = ", ".join(sorted(_model_at(loc[:-1]).model_fields))
            lines.append(f"  {key}: unknown key; allowed keys: {allowed}")
        elif isinstance(err["input"], Mapping):  # a cross-field rule or a missing key: the message names values
            lines.append(f"  {key}: {msg}")
        else:
            lines.append(f"  {key} = {err['input']!r}: {msg}")
    return "\n".join(lines)


def _written(loc: tuple[int | str, ...]) -> list[str]:
    """``loc`` as the user wrote the path: pydantic inserts the estimator's strategy tag (``estimator.spread.recall``)
    where the JSON has none (``estimator.recall``)."""
    return [str(part) for part in loc if part not in ESTIMATOR_CONFIGS]


def _model_at(loc: tuple[int | str, ...]) -> type[BaseModel]:
    """The model that validates the object at ``loc`` (a path of field names and list indices)."""
    model: type[BaseModel] = MTrainingConfig
    for part in loc:
        if isinstance(part, str) and part not in model.model_fields:  # a strategy's tag inside "estimator"
            model = ESTIMATOR_CONFIGS[part]
        elif isinstance(part, str):
            annotation = model.model_fields[part].annotation
            model = next(
                t for t in (annotation, *get_args(annotation)) if isinstance(t, type) and issubclass(t, BaseModel)
            )
    return model
