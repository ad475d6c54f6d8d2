"""Online budget approximation: estimate a :class:`VerticalSlashIndex` from a few observation rows.

Every forward, per layer and head, a handful of query rows (the *observation rows*; the baseline takes the
last ``last_q`` queries of the global sequence) attend to all keys::

    A = softmax(q_obs · Kᵀ · scale)   causal (key j <= row position p_i), fp32, [B, Hq, m, N], rows sum to 1

and the index that should hold for *all* rows is predicted from ``A`` alone. The baseline scores every key
column (``Σ_i A[i, j]``) and every *token* diagonal ``d = p_i - j`` (``Σ_i A[i, p_i - d]``) and selects in each
direction independently the fewest top candidates that reach that direction's recall target, clipped to its
``[min, max]`` budget. Chosen diagonals then become the block offsets their lines cross. Both traps described
in docs/design.md are avoided on purpose: the directions do not see each other's residual, and diagonals are
selected at token level, never pooled into ``bs``-wide bands first (a column seen by 64 rows spans 64
diagonals, which pooling would merge into one band and mistake for a slash line).

Forced entries (sink columns ``0..sink_tokens-1``, the tiles at offsets ``0..local_blocks-1``) are in the index
whatever the scores say, so they are not candidates — the ``[min, max]`` budget is never spent on them — and
the mass they already cover counts toward the recall target.

Strategies are pluggable through :data:`ESTIMATORS` (keyed by ``config.estimator``). A strategy maps
``(q, k, config, softmax_scale)`` to the index and the :class:`Observation` it was built from; the pieces it
is made of (observation attention, scores, recall-driven selection, diagonal-to-offset mapping, assembly,
observed recall) are separate functions so that other strategies can reuse them.

Layout: q ``[B, N, Hq, D]``, k ``[B, N, Hkv, D]``, ``Hq % Hkv == 0``; query head ``h`` reads kv head
``h // (Hq // Hkv)``. Everything here runs under ``torch.no_grad`` (the index is not differentiable) and is
deterministic: scores are reduced with ``gather`` + ``sum`` (no atomics) and ranked with a stable sort, so
ties go to the lower candidate index.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ds_mtraining.sparse.index import PAD, VerticalSlashIndex
from ds_mtraining.sparse.observe import Observation, last_rows, observation_attention, observed_recall
from ds_mtraining.sparse.scale import resolve_softmax_scale
from ds_mtraining.sparse.spread import spread_estimator

if TYPE_CHECKING:
    from ds_mtraining.config import SparseAttentionConfig

__all__ = [
    "ESTIMATORS",
    "EstimateReport",
    "Estimator",
    "assemble_index",
    "baseline_estimator",
    "diagonals_to_offsets",
    "estimate_index",
    "forced_diagonals",
    "select_by_recall",
    "slash_scores",
    "vertical_scores",
]


@dataclass(frozen=True)
class EstimateReport:
    """How well the estimated index covers what the estimator saw, and what it costs.

    Attributes:
        recall: float32 ``[B, Hq]``, observed-row softmax mass inside the index's mask / number of observed rows.
        density: float64 ``[B, Hq]``, attended fraction of the ``N (N + 1) / 2`` causal entries
            (:meth:`VerticalSlashIndex.density`).
    """

    recall: torch.Tensor
    density: torch.Tensor


Estimator = Callable[
    [torch.Tensor, torch.Tensor, "SparseAttentionConfig", float, bool], tuple[VerticalSlashIndex, torch.Tensor | None]
]
"""A strategy: ``(q, k, config, softmax_scale, observe) -> (index, recall)``; inputs already validated. With
``observe``, ``recall`` is the observation rows' mass inside the index / their number, float32 ``[B, Hq]``
(:func:`sparse.observe.observed_recall`); else ``None``."""


# ---------------------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------------------


def vertical_scores(attn: torch.Tensor) -> torch.Tensor:
    """Column score ``Σ_i A[i, j]``: ``attn`` float ``[B, Hq, m, N]`` -> float64 ``[B, Hq, N]``."""
    return attn.sum(dim=-2, dtype=torch.float64)


def slash_scores(attn: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Token-diagonal score ``Σ_i A[i, p_i - d]`` for ``d = 0 .. N-1``: float64 ``[B, Hq, N]``.

    ``attn`` is ``[B, Hq, m, N]`` over the observation rows at positions ``rows`` (``[m]``). Each row is read
    backwards from its own position with one ``gather`` (deterministic, unlike an atomic ``scatter_add``);
    diagonals a row cannot reach (``d > p_i``) contribute zero.
    """
    seqlen = attn.shape[-1]
    d = torch.arange(seqlen, device=attn.device)
    key = rows[:, None] - d[None, :]  # [m, N]: the key row i meets on diagonal d
    sheared = attn.gather(-1, key.clamp(min=0).expand(*attn.shape[:2], -1, -1))
    return torch.where(key >= 0, sheared, 0.0).sum(dim=-2, dtype=torch.float64)


def select_by_recall(scores: torch.Tensor, forced: int, target: float, *, minimum: int, maximum: int) -> torch.Tensor:
    """The fewest top-scoring candidates whose mass, with the forced candidates', reaches ``target``.

    Args:
        scores: float ``[B, Hq, C]``, non-negative candidate scores (mass seen by the observation rows).
        forced: the first ``forced`` candidates are in the index anyway (sinks, diagonals inside the local
            tiles): never selected or counted against the budget, but their mass is credited toward ``target``.
        target: mass to reach (recall × number of observation rows, since each row sums to 1).
        minimum, maximum: the number of selected (non-forced) candidates is clipped into this range, then
            to the number of non-forced candidates.

    Returns:
        LongTensor ``[B, Hq, min(maximum, C - #forced)]``: candidate indices by descending score (ties: lower
        index first), padded with -1 past each head's count.
    """
    forced = min(max(forced, 0), scores.shape[-1])
    free = scores.shape[-1] - forced
    width = max(0, min(maximum, free))
    credit = scores[..., :forced].sum(dim=-1, dtype=torch.float64)  # [B, Hq]
    values, order = scores[..., forced:].sort(dim=-1, descending=True, stable=True)
    reached = credit[..., None] + values.cumsum(dim=-1, dtype=torch.float64)  # after n + 1 picks
    # Smallest n with credit + (sum of the top n) >= target; when never reached it exceeds `free` and the
    # clamp below takes every free candidate.
    need = (credit < target).long() + (reached < target).sum(dim=-1)
    need = need.clamp(min=minimum).clamp(max=min(maximum, free))
    keep = torch.arange(width, device=scores.device) < need[..., None]
    return torch.where(keep, order[..., :width] + forced, PAD)


def forced_diagonals(block_size: int, local_blocks: int) -> int:
    """Number of leading token diagonals whose every block offset is forced (``< max(local_blocks, 1)``).

    A diagonal ``d`` crosses offsets ``d // bs`` and, unless ``d % bs == 0``, ``d // bs + 1``, so the covered
    ones are ``d <= (local_blocks - 1) * bs``; offset 0 is always in the index, so ``d = 0`` always is.
    """
    return (max(local_blocks, 1) - 1) * block_size + 1


def diagonals_to_offsets(diagonals: torch.Tensor, block_size: int, num_blocks: int) -> torch.Tensor:
    """Block offsets crossed by token diagonals.

    ``diagonals``: LongTensor ``[B, Hq, K]``, -1 padded. Returns LongTensor ``[B, Hq, 2K]``, -1 padded (not
    canonical): ``d // bs`` and, when the line straddles two tiles (``d % bs != 0``), ``d // bs + 1``;
    offsets ``>= num_blocks`` do not exist and are dropped.
    """
    low = diagonals // block_size
    high = torch.where(diagonals % block_size != 0, low + 1, PAD)
    offsets = torch.cat([low, high], dim=-1)
    valid = (torch.cat([diagonals, diagonals], dim=-1) >= 0) & (offsets >= 0) & (offsets < num_blocks)
    return torch.where(valid, offsets, PAD)


def assemble_index(
    columns: torch.Tensor, diagonals: torch.Tensor, seqlen: int, config: SparseAttentionConfig
) -> VerticalSlashIndex:
    """Canonical index from selected columns and token diagonals plus the forced sinks and local tiles.

    ``columns``: LongTensor ``[B, Hq, Kv]`` key positions; ``diagonals``: LongTensor ``[B, Hq, Kd]`` token
    distances; both -1 padded.
    """
    batch, heads = columns.shape[:2]
    device = columns.device
    bs = config.block_size
    nblocks = -(-seqlen // bs)
    sinks = torch.arange(min(config.sink_tokens, seqlen), device=device).expand(batch, heads, -1)
    local = torch.arange(min(config.local_blocks, nblocks), device=device).expand(batch, heads, -1)
    vertical = torch.cat([sinks, columns], dim=-1)
    slash = torch.cat([local, diagonals_to_offsets(diagonals, bs, nblocks)], dim=-1)
    return VerticalSlashIndex.build(vertical, slash, bs)


# ---------------------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------------------


def baseline_select(
    vertical: torch.Tensor, slash: torch.Tensor, rows: int, seqlen: int, config: SparseAttentionConfig
) -> VerticalSlashIndex:
    """The baseline's selection from its scores (float64 ``[B, Hq, N]`` column and token-diagonal scores).

    Columns: top scores until ``vertical_recall`` of the mass of the ``rows`` observation rows (sinks forced
    and credited), clipped to ``[vertical_min, vertical_max]``. Diagonals likewise with ``slash_recall``
    (diagonals inside the local tiles forced and credited), clipped to ``[slash_min, slash_max]``.
    """
    mass = float(rows)  # each row sums to 1
    columns = select_by_recall(
        vertical,
        config.sink_tokens,
        config.vertical_recall * mass,
        minimum=config.vertical_min,
        maximum=config.vertical_max,
    )
    diagonals = select_by_recall(
        slash,
        forced_diagonals(config.block_size, config.local_blocks),
        config.slash_recall * mass,
        minimum=config.slash_min,
        maximum=config.slash_max,
    )
    return assemble_index(columns, diagonals, seqlen, config)


def baseline_estimator(
    q: torch.Tensor, k: torch.Tensor, config: SparseAttentionConfig, softmax_scale: float, observe: bool
) -> tuple[VerticalSlashIndex, torch.Tensor | None]:
    """The authors' online budget approximation: the last ``last_q`` rows, each direction on its own.

    Scores: column ``Σ_i A[i, j]`` and token diagonal ``Σ_i A[i, p_i - d]``; selection: :func:`baseline_select`.
    """
    seqlen = q.shape[1]
    rows = last_rows(seqlen, config.last_q, q.device)
    attn = observation_attention(q, k, rows, softmax_scale)
    index = baseline_select(vertical_scores(attn), slash_scores(attn, rows), rows.numel(), seqlen, config)
    if not observe:
        return index, None
    return index, observed_recall(index, Observation(rows, attn, torch.arange(seqlen, device=q.device), seqlen))


ESTIMATORS: dict[str, Estimator] = {"baseline": baseline_estimator, "spread": spread_estimator}
"""Estimation strategies by ``SparseAttentionConfig.estimator``."""


# ---------------------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------------------


def check_inputs(q: torch.Tensor, k: torch.Tensor, config: SparseAttentionConfig) -> None:
    """Shapes, dtypes, devices and config of an estimation call; raises with the problem and the fix."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"estimate_index: {name} must be a 4-D tensor [B, N, H, D]; got {got}")
        if not t.is_floating_point():
            raise TypeError(f"estimate_index: {name} must have a floating dtype; got {t.dtype}")
    if q.device != k.device:
        raise ValueError(f"estimate_index: q is on {q.device} but k is on {k.device}; move them to one device")
    (bq, nq, hq, dq), (bk, nk, hkv, dk) = q.shape, k.shape
    if (bq, nq, dq) != (bk, nk, dk):
        raise ValueError(
            f"estimate_index: q [B, N, Hq, D] = {tuple(q.shape)} and k [B, N, Hkv, D] = {tuple(k.shape)} must agree "
            "on B, N and D"
        )
    if nq == 0:
        raise ValueError("estimate_index: the sequence is empty (N = 0)")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"estimate_index: query heads Hq={hq} must be a multiple of kv heads Hkv={hkv} (GQA: head h reads kv "
            "head h // (Hq // Hkv))"
        )
    if config.pattern == "dense":
        raise ValueError(
            "estimate_index: config.pattern is 'dense'; dense layers attend every causal entry and need no index "
            "(use VerticalSlashIndex.dense or skip estimation for this layer)"
        )
    if config.estimator not in ESTIMATORS:
        raise ValueError(f"estimate_index: unknown estimator {config.estimator!r}; registered: {sorted(ESTIMATORS)}")


@torch.no_grad()
def estimate_index(
    q: torch.Tensor,
    k: torch.Tensor,
    config: SparseAttentionConfig,
    *,
    softmax_scale: float | None = None,
    return_report: bool = False,
) -> VerticalSlashIndex | tuple[VerticalSlashIndex, EstimateReport]:
    """Estimate the vertical-slash index of a causal attention layer from a few observation rows.

    Args:
        q: ``[B, N, Hq, D]`` queries (global sequence order), any float dtype; computed in fp32.
        k: ``[B, N, Hkv, D]`` keys, ``Hq % Hkv == 0``; query head ``h`` uses kv head ``h // (Hq // Hkv)``.
        config: a ``SparseAttentionConfig`` with ``pattern="vertical_slash"``; ``config.estimator`` picks the
            strategy in :data:`ESTIMATORS`; budgets, recall targets, sinks and local tiles come from it.
        softmax_scale: logit scale; default ``D ** -0.5``.
        return_report: also return an :class:`EstimateReport` (observed recall and exact density per head).

    Returns:
        The canonical :class:`VerticalSlashIndex` (``[B, Hq, ·]``, ``block_size = config.block_size``), or
        ``(index, report)`` when ``return_report``.

    Raises:
        ValueError: mismatched shapes, ``Hq % Hkv != 0``, tensors on different devices, ``pattern="dense"``,
            an unknown estimator or a non-positive scale.
        TypeError: q or k not floating point.
    """
    check_inputs(q, k, config)
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1], "estimate_index")
    index, recall = ESTIMATORS[config.estimator](q, k, config, scale, return_report)
    if not return_report:
        return index
    return index, EstimateReport(recall=recall, density=index.density(q.shape[1]))
