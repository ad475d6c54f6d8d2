"""Weak heads of the spread estimator on a real model: where their missed mass is, and greedy variants against the
oracle, from captured q/k (CPU-sized: each step is cached on disk, so variants cost seconds, not a model run).

    python -m benchmarks.weak_heads capture --length 16384 --work DIR            # q/k of every layer (post-RoPE)
    python -m benchmarks.weak_heads stats --length 16384 --layers 1 2 --work DIR  # per head: block sums + oracle path
    python -m benchmarks.weak_heads diagnose --length 16384 --layers 1 --work DIR --out FILE
    python -m benchmarks.weak_heads compare --length 16384 --layers 1 2 --work DIR --out FILE \\
        --variant before:8,32,128,512,1536 --variant now: --variant c2048:8,32,128,512,1536,1536:2048

The model is SmolLM2-135M with YaRN x4 (``--rope-factor``), one held-out row (``launch/eval.py``'s
``heldout_rows``, seed 0), fp32; the sparse settings are ``--ds-config``'s. True recall, density and the oracle's
density at equal recall are the fidelity harness's (``eval.metrics``: ``index_recall``, ``oracle_path``, its
``density_at``), so ``compare`` reproduces ``launch/eval.py fidelity``'s per-head numbers (its relative error
aside) for any greedy schedule and column cap. ``--work`` holds the cached steps, ``--out`` the report of ``diagnose``
or ``compare``.
"""

from __future__ import annotations

import argparse
import dataclasses
import runpy
import sys
from pathlib import Path

import torch

from benchmarks import harness
from ds_mtraining.config import MTrainingConfig
from ds_mtraining.estimator.reduce import LocalReducer
from ds_mtraining.estimator.spread import greedy
from ds_mtraining.estimator.spread.candidates import candidate_attention, candidate_columns
from ds_mtraining.estimator.spread.report import index_recall as observed_recall
from ds_mtraining.estimator.spread.settings import SpreadSettings
from ds_mtraining.estimator.spread.strategy import SpreadStrategy
from ds_mtraining.estimator.spread.tail import tail_columns
from ds_mtraining.estimator.strategy import Shard
from ds_mtraining.eval.metrics import BlockStats, OraclePath, index_recall, oracle_path
from ds_mtraining.sparse.index import VerticalSlashIndex

ROWS_PER_CHUNK = 1024  # rows of one head's attention held at a time: [1024, N] fp32 (64 MB at 16K)
EVAL = Path(__file__).resolve().parents[1] / "launch" / "eval.py"


def capture(args, report: harness.Report) -> None:
    """q/k of each layer of one dense forward, ``qk_{N}_l{layer}.pt``; stops after the last of ``--layers``."""
    heldout_rows = runpy.run_path(str(EVAL))["heldout_rows"]  # the harness's held-out rows, as it reads them

    from ds_mtraining.config import SparseAttentionConfig
    from ds_mtraining.integration.transformers import NAME, MTrainingAttention
    from ds_mtraining.models import RopeScaling, load_pretrained

    model, tokenizer = load_pretrained(
        "smollm2-135m", rope=RopeScaling(kind="yarn", factor=args.rope_factor), attn_implementation=NAME
    )
    ids = heldout_rows(tokenizer, args.length, 1, seed=0)
    last = max(args.layers) if args.layers else model.config.num_hidden_layers - 1

    class Done(Exception):
        pass

    def probe(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
        torch.save({"q": q.clone(), "k": k.clone(), "scale": scale}, args.work / f"qk_{args.length}_l{layer}.pt")
        if layer == last:
            raise Done  # the later layers are not needed: skip their forward

    try:
        with torch.no_grad():
            model(
                ids, mtraining=MTrainingAttention(SparseAttentionConfig(pattern="dense"), probe=probe), use_cache=False
            )
    except Done:
        pass
    report.add(f"captured layers 0-{last} of {args.length} tokens into {args.work}")


def _load(args, layer: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    d = torch.load(args.work / f"qk_{args.length}_l{layer}.pt")
    return d["q"].float(), d["k"].float(), d["scale"]


def _head_rows(q: torch.Tensor, k: torch.Tensor, scale: float, head: int):
    """Yield ``(first row, causal softmax [ROWS_PER_CHUNK, N] fp32)`` of one head, chunk by chunk."""
    n, hq, hkv = q.shape[1], q.shape[2], k.shape[2]
    qh, kh = q[0, :, head], k[0, :, head // (hq // hkv)]
    for c0 in range(0, n, ROWS_PER_CHUNK):
        rows = torch.arange(c0, min(c0 + ROWS_PER_CHUNK, n))
        logits = (qh[rows] @ kh.T) * scale
        yield c0, torch.softmax(logits.masked_fill(torch.arange(n)[None, :] > rows[:, None], float("-inf")), -1)


def stats(args, report: harness.Report) -> None:
    """Per head: the block column sums (``BlockStats.full``, stored fp32) and the oracle path's density / recall."""
    bs = 64
    for layer in args.layers:
        q, k, scale = _load(args, layer)
        n = q.shape[1]
        for h in range(q.shape[2]):
            full = torch.zeros(n // bs, n, dtype=torch.float64)
            for c0, p in _head_rows(q, k, scale, h):
                full[c0 // bs : (c0 + p.shape[0]) // bs] = p.view(-1, bs, n).sum(1).double()
            path = oracle_path(BlockStats(full, full, n, bs), max_recall=0.995)
            torch.save(
                {"full": full.float(), "density": path.density, "recall": path.recall},
                args.work / f"stats_{n}_l{layer}_h{h}.pt",
            )
        report.add(f"layer {layer}: the stats of {q.shape[2]} heads in {args.work}")


@dataclasses.dataclass
class Estimate:
    """One layer's estimate, step by step (``SpreadStrategy``'s steps, the greedy's schedule open)."""

    index: VerticalSlashIndex
    observed: torch.Tensor  # float32 [Hq], the staggered rows' recall
    rows: torch.Tensor


def estimate(q, k, scale, settings: SpreadSettings, schedule: tuple[int, ...] | None) -> Estimate:
    n, strategy, reducer = q.shape[1], SpreadStrategy(), LocalReducer.of(q)
    rows_all = strategy.rows(n, settings, q.device)
    obs = strategy.evidence(
        Shard(reducer.gather_rows(q, rows_all), k, reducer.keys, rows_all, n, scale), settings, reducer
    )
    m = rows_all.numel() - obs.tail
    rows, q_rows = rows_all[:m], q[:, rows_all[:m]]
    row_max, row_sum = obs.statistics.row_max[..., :m], obs.statistics.row_sum[..., :m]
    cands = candidate_columns(obs.evidence, rows, n, settings)
    cand_attn = candidate_attention(q_rows, k, rows, reducer.keys, cands, row_max, row_sum, scale, n)
    index = greedy.spread_select(obs.evidence.block_mass, cands, cand_attn, rows, n, settings, schedule=schedule)
    index = tail_columns(index, obs.evidence.tail_sum, n, obs.tail, settings)
    columns = torch.where(index.vertical >= 0, index.vertical, n)
    column_attn = candidate_attention(q_rows, k, rows, reducer.keys, columns, row_max, row_sum, scale, n)
    return Estimate(index, observed_recall(index, obs.evidence.block_mass, column_attn, rows, n)[0], rows)


def _settings(args, layer: int, max_columns: int | None = None) -> SpreadSettings:
    config = MTrainingConfig.from_deepspeed_config(args.ds_config).sparse_attention.for_layer(layer)
    settings = SpreadSettings.of(config)
    return settings if max_columns is None else dataclasses.replace(settings, max_columns=max_columns)


def _truth(args, layer: int, head: int, index: VerticalSlashIndex) -> tuple[float, float]:
    """(true recall over all rows, oracle density at that recall) of one head, from the cached stats."""
    d = torch.load(args.work / f"stats_{args.length}_l{layer}_h{head}.pt")
    full = d["full"].double()
    recall, _ = index_recall(BlockStats(full, full, args.length, index.block_size), index, 0, head)
    path = OraclePath(d["density"], d["recall"], d["recall"], torch.empty(0), torch.empty(0))
    return recall, path.density_at(recall)


def diagnose(args, report: harness.Report) -> None:
    """Per head under ``--below`` true recall: caps, where the missed mass is (rows, near band, columns, offsets)."""
    report.add(
        "| layer | head | density | oracle density at its recall | observed recall | true recall, staggered rows | "
        "true recall | columns | offsets | missed per eighth of the rows | missed | missed within exclusion | "
        "best 64 / 1024 more columns would take | best 16 / 64 more offsets would take |",
        "|---" * 14 + "|",
    )
    for layer in args.layers:
        q, k, scale = _load(args, layer)
        settings = _settings(args, layer)
        est = estimate(
            q, k, scale, settings, greedy.rounds(settings.max_columns)[: args.rounds] if args.rounds else None
        )
        n, bs = q.shape[1], settings.block_size
        nb, columns, offsets = n // bs, est.index.column_mask(n)[0], est.index.offset_mask(n)[0]
        for h in range(q.shape[2]):
            recall, oracle = _truth(args, layer, h, est.index)
            if recall >= args.below:
                continue
            row_miss = torch.zeros(n, dtype=torch.float64)
            col_miss = torch.zeros(n, dtype=torch.float64)
            tile_miss = torch.zeros(nb, nb, dtype=torch.float64)
            near = 0.0
            key_block = torch.arange(n) // bs
            for c0, p in _head_rows(q, k, scale, h):
                i = torch.arange(c0, c0 + p.shape[0])
                inside = offsets[h][(i[:, None] // bs - key_block[None, :]).clamp(min=0)] | columns[h][None, :]
                miss = torch.where(inside, 0.0, p)  # p is 0 above the diagonal
                row_miss[i] = miss.sum(1, dtype=torch.float64)
                col_miss += miss.sum(0, dtype=torch.float64)
                tile_miss[c0 // bs : (c0 + p.shape[0]) // bs] = miss.view(-1, bs, nb, bs).sum(
                    (1, 3), dtype=torch.float64
                )
                near_band = i[:, None] - torch.arange(n)[None, :] < settings.exclusion
                near += float(torch.where(near_band, miss, 0.0).sum(dtype=torch.float64))
            per_offset = torch.stack([tile_miss.diagonal(-o).sum() for o in range(nb)]) / n
            # What the best k more would take; all there are when a short sequence has fewer than k.
            top_cols = (col_miss / n).sort(descending=True).values.cumsum(0).tolist()
            top_offs = per_offset.sort(descending=True).values.cumsum(0).tolist()
            segments = " ".join(f"{x:.2f}" for x in row_miss.view(8, -1).mean(1).tolist())
            report.add(
                f"| {layer} | {h} | {float(est.index.density(n)[0, h]):.3f} | {oracle:.3f} | {float(est.observed[h]):.3f} | "
                f"{1 - float(row_miss[est.rows].mean()):.3f} | {recall:.3f} | {int(columns[h].sum()) - settings.sink_tokens} | "
                f"{int(offsets[h].sum()) - 1} | {segments} | {float(row_miss.mean()):.3f} | {near / n:.3f} | "
                f"{top_cols[:64][-1]:.3f} / {top_cols[:1024][-1]:.3f} | "
                f"{top_offs[:16][-1]:.3f} / {top_offs[:64][-1]:.3f} |"
            )


def compare(args, report: harness.Report) -> None:
    """Per variant (``name:schedule[:max_columns]``, an empty schedule = the default ``greedy.rounds``): the
    harness's summary over ``--layers``' heads (min recall, heads under 0.75 / 0.8, mean density, ratio to the oracle
    at equal recall)."""
    variants = {}
    for spec in args.variant:
        name, schedule, *cap = spec.split(":")
        sched = tuple(int(x) for x in schedule.split(",")) if schedule else None
        variants[name] = (sched, int(cap[0]) if cap else None)
    heads = {name: [] for name in variants}
    for layer in args.layers:
        q, k, scale = _load(args, layer)
        for name, (schedule, cap) in variants.items():
            index = estimate(q, k, scale, _settings(args, layer, cap), schedule).index
            density = index.density(q.shape[1])[0]
            for h in range(q.shape[2]):
                heads[name].append((layer, h, float(density[h]), *_truth(args, layer, h, index)))
        print(f"layer {layer} done", file=sys.stderr, flush=True)
    report.add(
        "| variant | heads | min recall | < 0.75 / < 0.8 | mean recall | mean density | oracle at equal recall | ratio |",
        "|---|---|---|---|---|---|---|---|",
    )
    for name, rs in heads.items():
        recalls = [r[3] for r in rs]
        density, oracle = sum(r[2] for r in rs) / len(rs), sum(r[4] for r in rs) / len(rs)
        report.add(
            f"| {name} | {len(rs)} | {min(recalls):.3f} | {sum(x < 0.75 for x in recalls)} / {sum(x < 0.8 for x in recalls)} "
            f"| {sum(recalls) / len(recalls):.4f} | {density:.4f} | {oracle:.4f} | {density / oracle:.3f} |"
        )
    torch.save(heads, args.work / f"compare_{args.length}.pt")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["capture", "stats", "diagnose", "compare"])
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--layers", type=int, nargs="+")
    parser.add_argument("--work", type=Path, required=True, help="folder of the cached q/k and stats")
    parser.add_argument("--out", help="the report")
    parser.add_argument("--rope-factor", type=float, default=4.0)
    parser.add_argument("--ds-config", type=Path, default=Path("ds_configs/zero2_offload.json"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--below", type=float, default=0.8, help="diagnose: heads under this true recall")
    parser.add_argument("--rounds", type=int, help="diagnose: only the schedule's first ROUNDS rounds")
    parser.add_argument("--variant", action="append", default=[], help="compare: name:schedule[:max_columns]")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    report = harness.Report(args.out)
    title = f"Weak heads of the spread estimator: {args.command}"
    report.add(*harness.header(title, __spec__.name, argv, device="cpu"), "")
    {"capture": capture, "stats": stats, "diagnose": diagnose, "compare": compare}[args.command](args, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
