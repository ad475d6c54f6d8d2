"""Attention fidelity on real text through a real model: estimator vs oracle, per layer and head.

One dense forward pass; at every layer a probe takes the (post-RoPE) q/k/v and, per query head:

- the full causal attention matrix ``P`` and its per-block column sums (:mod:`ds_mtraining.eval.metrics`);
- the estimated index (``estimate_index`` with the layer's settings): density, true recall over all rows and
  over the last ``last_rows`` rows, the estimator's own observed recall, and the relative error of the sparse
  attention output against dense attention;
- the greedy oracle index at each recall target: the density it needs, and its recall over the last rows;
  and the density the oracle needs for the recall the estimated index actually has (interpolated on the
  head's oracle path): the estimator's cost against the best index of the same family at *equal* recall.

The model itself runs dense, so every layer sees the inputs the dense model would (fidelity per layer, not
accumulated error; the perplexity evaluation measures the accumulated effect).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ds_mtraining.config import SparseAttentionConfig
from ds_mtraining.estimator import estimate_index
from ds_mtraining.eval.metrics import block_stats, causal_probs, index_recall, oracle_paths, relative_error
from ds_mtraining.integration.transformers import MTrainingAttention
from ds_mtraining.sparse import AttentionPattern, masked_sparse_attention, vertical_slash_attention

__all__ = ["HeadFidelity", "fidelity_summary", "fidelity_table", "measure_fidelity", "plot_fidelity"]

DEFAULT_TARGETS = (0.85, 0.90, 0.93, 0.95, 0.97)
ORACLE_BYTES = 4 << 30
"""Bound on one group of heads' block statistics (the oracle copies them once more): SmolLM2's 9 heads at 32K, 2.4 GB,
are one group."""


@dataclass
class HeadFidelity:
    """One head's numbers (see the module docstring)."""

    layer: int
    head: int
    est_density: float
    est_recall: float
    est_recall_last: float
    est_observed_recall: float
    rel_error: float
    oracle_at_recall: float
    """Oracle density at ``est_recall`` (1.0 for a dense layer)."""
    oracle: dict[float, tuple[float, float, float]] = field(default_factory=dict)
    """target -> (density, recall all rows, recall last rows) of the oracle index first reaching it."""


@torch.no_grad()
def measure_fidelity(
    model,
    input_ids: torch.Tensor,
    sparse: SparseAttentionConfig,
    *,
    targets: Sequence[float] = DEFAULT_TARGETS,
    last_rows: int = 1024,
    masked: bool = False,
    keep_indices: bool = False,
    layers: Collection[int] | None = None,
    advance: Callable[[], object] | None = None,
) -> tuple[list[HeadFidelity], dict[int, dict[str, torch.Tensor]]]:
    """Run ``model`` (registered with ``attn_implementation="mtraining"``) densely on ``input_ids`` ``[1, N]``.

    Returns the per-head records and, if ``keep_indices``, layer -> ``{"vertical", "slash"}`` of the
    estimated index (int16/int32 CPU tensors, for benchmarks that want real patterns). ``layers``: measure only
    these (``None``: every layer); the others still run, densely. ``advance`` is called after each layer, measured
    or not.
    """
    records: list[HeadFidelity] = []
    indices: dict[int, dict[str, torch.Tensor]] = {}
    top = max(targets)

    def probe(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
        if layers is not None and layer not in layers:
            if advance is not None:
                advance()
            return
        config = sparse.for_layer(layer)
        n, hq, hkv = q.shape[1], q.shape[2], k.shape[2]
        bs = config.block_size
        dense_out = vertical_slash_attention(q, k, v, None, softmax_scale=scale)
        if config.pattern == "dense":
            index, report, err = None, None, torch.zeros(1, hq, dtype=torch.float64)
        else:
            index, report = estimate_index(q, k, config, softmax_scale=scale, return_report=True)
            pattern = AttentionPattern(n, index)
            if masked:
                out = masked_sparse_attention(q, k, v, pattern, scale)
            else:
                out = vertical_slash_attention(q, k, v, pattern, softmax_scale=scale)
            err = relative_error(out, dense_out).cpu()
            density, observed = report.density[0].cpu(), report.recall[0].cpu()
            if keep_indices:
                indices[layer] = {
                    "vertical": index.vertical.to("cpu", torch.int32),
                    "slash": index.slash.to("cpu", torch.int32),
                }
        # The oracle takes a group of heads at once on the stats' device (``oracle_paths``: a GPU runs its loop
        # without a synchronisation per step); a group's [nb, N] float64 stats stay under ORACLE_BYTES.
        group = max(1, ORACLE_BYTES // (16 * (n // bs) * n))
        for first in range(0, hq, group):
            heads = range(first, min(first + group, hq))
            stats = [
                block_stats(causal_probs(q[0, :, h], k[0, :, h // (hq // hkv)], scale), bs, min(last_rows, n))
                for h in heads
            ]
            ests = [
                (1.0, 1.0, 1.0, 1.0)
                if index is None
                else (float(density[h]), *index_recall(stats[i], index, 0, h), float(observed[h]))
                for i, h in enumerate(heads)
            ]
            # Far enough to reach the estimated index's own recall (the yardstick at equal recall).
            goals = [top if index is None else max(top, min(est[1] + 1e-3, 0.995)) for est in ests]
            for h, est, path in zip(heads, ests, oracle_paths(stats, goals), strict=True):
                oracle = {}
                for target in targets:
                    s = path.first_reaching(target)
                    oracle[target] = (float(path.density[s]), float(path.recall[s]), float(path.recall_last[s]))
                equal = 1.0 if index is None else path.density_at(est[1])
                records.append(HeadFidelity(layer, h, *est, float(err[0, h]), equal, oracle))
        if advance is not None:
            advance()

    dense = MTrainingAttention(SparseAttentionConfig(pattern="dense"), probe=probe)
    model(input_ids, mtraining=dense, use_cache=False)
    return records, indices


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def fidelity_summary(records: Sequence[HeadFidelity]) -> str:
    """Markdown: the estimator against the oracle over the sparse layers' heads (dense layers left out)."""
    sparse = [r for r in records if r.est_density < 1.0 or r.est_recall < 1.0]
    if not sparse:
        return "(every layer dense)"
    density = _mean(r.est_density for r in sparse)
    equal = _mean(r.oracle_at_recall for r in sparse)
    recalls = [r.est_recall for r in sparse]
    rows = [
        ("heads (sparse layers)", f"{len(sparse)} of {len(records)}"),
        ("mean density", f"{density:.4f}"),
        (
            "mean true recall, all rows / last rows",
            f"{_mean(recalls):.4f} / {_mean(r.est_recall_last for r in sparse):.4f}",
        ),
        ("oracle density at each head's recall (mean)", f"{equal:.4f}"),
        ("**density / oracle density at equal recall**", f"**{density / equal:.3f}**"),
        ("heads under 0.8 / 0.75 true recall", f"{sum(x < 0.8 for x in recalls)} / {sum(x < 0.75 for x in recalls)}"),
        ("lowest head recall", f"{min(recalls):.3f}"),
    ]
    return "| over the sparse layers | value |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)


def fidelity_table(records: Sequence[HeadFidelity], targets: Sequence[float] = DEFAULT_TARGETS) -> str:
    """Markdown: one row per layer (means over its heads), then the all-heads mean; oracle density per target."""
    layers = sorted({r.layer for r in records})
    head = (
        "| layer | est. density | est. recall (all) | est. recall (last) | observed recall | rel. error | "
        + " | ".join(f"oracle dens. @{t:.2f}" for t in targets)
        + " |"
    )
    lines = [head, "|" + "---|" * (6 + len(targets))]

    def row(name: str, rs: Sequence[HeadFidelity]) -> str:
        cells = [
            _mean(r.est_density for r in rs),
            _mean(r.est_recall for r in rs),
            _mean(r.est_recall_last for r in rs),
            _mean(r.est_observed_recall for r in rs),
            _mean(r.rel_error for r in rs),
        ] + [_mean(r.oracle[t][0] for r in rs) for t in targets]
        return f"| {name} | " + " | ".join(f"{c:.3f}" for c in cells) + " |"

    for layer in layers:
        lines.append(row(str(layer), [r for r in records if r.layer == layer]))
    lines.append(row("**all**", records))
    return "\n".join(lines)


def records_to_json(records: Sequence[HeadFidelity]) -> list[dict]:
    """Plain dicts (oracle targets as strings) for ``json.dump``."""
    out = []
    for r in records:
        d = asdict(r)
        d["oracle"] = {f"{t:.2f}": list(v) for t, v in r.oracle.items()}
        out.append(d)
    return out


def plot_fidelity(
    records: Sequence[HeadFidelity], path: str | Path, title: str, targets: Sequence[float] = DEFAULT_TARGETS
) -> Path:
    """PNG: true recall vs density; oracle per head (small dots) and mean curve, estimator per head."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for i, t in enumerate(targets):
        ax.scatter(
            [r.oracle[t][0] for r in records],
            [r.oracle[t][1] for r in records],
            s=4,
            alpha=0.25,
            color="tab:blue",
            label="oracle, per head" if i == 0 else None,
        )
    ax.plot(
        [_mean(r.oracle[t][0] for r in records) for t in targets],
        [_mean(r.oracle[t][1] for r in records) for t in targets],
        "o-",
        color="tab:blue",
        label="oracle, mean over heads (targets " + ", ".join(f"{t:.2f}" for t in targets) + ")",
    )
    ax.scatter(
        [r.est_density for r in records],
        [r.est_recall for r in records],
        s=8,
        alpha=0.6,
        color="tab:red",
        label="estimator, per head",
    )
    ax.plot(
        [_mean(r.est_density for r in records)],
        [_mean(r.est_recall for r in records)],
        "*",
        ms=16,
        color="darkred",
        label="estimator, mean",
    )
    ax.set_xlabel("density (attended / causal entries)")
    ax.set_ylabel("true recall (mean softmax mass inside the index, all rows)")
    ax.set_xscale("log")
    ax.set_ylim(0.5, 1.0)
    ax.grid(True, alpha=0.3)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
