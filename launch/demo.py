"""Demo of the single-device pipeline on planted structure: estimate an index online, attend sparsely.

    python launch/demo.py [--deepspeed ds_configs/zero2_offload.json] [--seqlen 8192] [--heads 4]

q/k carry a planted vertical-slash structure (a sink, three far columns, a local band and two far diagonals
per head, at random positions; ``ds_mtraining.sparse.planted.plant_head``), v is random. The estimator reads
the sparse-attention settings of one layer from the config; the demo then runs sparse and dense attention
forward and backward on the same inputs and prints what the index costs and what it keeps.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from ds_mtraining.config import ConfigError, MTrainingConfig
from ds_mtraining.console import print_error
from ds_mtraining.estimator import estimate_index
from ds_mtraining.sparse import index_to_dense_mask, vertical_slash_attention
from ds_mtraining.sparse.planted import plant_head


def _planted_inputs(seqlen: int, heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    qs, ks = [], []
    for h in range(heads):
        far = torch.randint(256, seqlen - 256, (5,), generator=gen).tolist()
        q, k = plant_head(
            seqlen,
            columns={c: 0.12 for c in far[:3]},
            diagonals={0: 0.15, 17: 0.1, 45: 0.05, far[3]: 0.12, far[4]: 0.12},
            sink=0.1,
            seed=seed + h,
        )
        qs.append(q)
        ks.append(k)
    q = torch.stack(qs, dim=1)[None].float()
    k = torch.stack(ks, dim=1)[None].float()
    v = torch.randn(k.shape, generator=gen)
    return q, k, v


def _timed_fwd_bwd(q, k, v, index) -> tuple[torch.Tensor, float]:
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    start = time.perf_counter()
    out = vertical_slash_attention(q, k, v, index, softmax_scale=1.0)
    out.square().sum().backward()
    return out.detach(), time.perf_counter() - start


def check_args(args: argparse.Namespace):
    """The layer's sparse settings from ``--deepspeed``, after checking the numbers the demo can use."""
    if args.seqlen <= 512:
        raise ValueError(
            f"--seqlen must be > 512 (the planted far columns sit 256 tokens from either end); got {args.seqlen}"
        )
    if args.heads < 1 or args.layer < 0:
        raise ValueError(f"--heads must be >= 1 and --layer >= 0; got {args.heads} and {args.layer}")
    if not Path(args.deepspeed).is_file():
        raise FileNotFoundError(
            f'--deepspeed {args.deepspeed} not found; pass a DeepSpeed JSON with an "mtraining" section, e.g. '
            "ds_configs/zero2_offload.json"
        )
    return MTrainingConfig.from_deepspeed_config(args.deepspeed).sparse_attention.for_layer(args.layer)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed", default="ds_configs/zero2_offload.json", help="DeepSpeed JSON with our section")
    parser.add_argument("--layer", type=int, default=3, help="whose sparse-attention settings to use")
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        config = check_args(args)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print_error(e)
        return 2
    console = Console()
    if config.pattern == "dense":
        console.print(f"layer {args.layer} is dense in {args.deepspeed}; pick a sparse layer with --layer")
        return 0
    q, k, v = _planted_inputs(args.seqlen, args.heads, args.seed)

    start = time.perf_counter()
    index, report = estimate_index(q, k, config, softmax_scale=1.0, return_report=True)
    estimate_s = time.perf_counter() - start
    sparse_out, sparse_s = _timed_fwd_bwd(q, k, v, index)
    dense_out, dense_s = _timed_fwd_bwd(q, k, v, None)

    # True recall on the last 1K rows, from their dense softmax (the first rows would need O(N²) memory).
    rows = torch.arange(max(0, args.seqlen - 1024), args.seqlen)
    logits = torch.einsum("bmhd,bnhd->bhmn", q[:, rows], k)
    attn = logits.masked_fill(torch.arange(args.seqlen) > rows[:, None], float("-inf")).softmax(-1)
    mask = index_to_dense_mask(index, args.seqlen)[:, :, rows]
    true_recall = (attn * mask).sum(-1).mean(-1)
    error = (sparse_out - dense_out).norm(dim=-1) / dense_out.norm(dim=-1)

    table = Table(title=f"vertical-slash attention, N={args.seqlen}, config {args.deepspeed} layer {args.layer}")
    for column in (
        "head",
        "columns",
        "slash offsets",
        "density",
        "observed recall",
        "true recall (last 1K)",
        "median rel. error",
    ):
        table.add_column(column, justify="right")
    for h in range(args.heads):
        table.add_row(
            str(h),
            str(int((index.vertical[0, h] >= 0).sum())),
            str(int((index.slash[0, h] >= 0).sum())),
            f"{report.density[0, h]:.3f}",
            f"{report.recall[0, h]:.3f}",
            f"{true_recall[0, h]:.3f}",
            f"{error[0, :, h].median():.2e}",
        )
    console.print(table)
    console.print(
        f"estimate {1e3 * estimate_s:.0f} ms · sparse fwd+bwd {1e3 * sparse_s:.0f} ms · "
        f"dense (SDPA) fwd+bwd {1e3 * dense_s:.0f} ms · speed-up {dense_s / sparse_s:.1f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
