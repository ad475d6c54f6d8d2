"""flash-attn-4's block-sparse kernels on the whole vertical-slash index (slash + columns) vs ours and cuDNN (issue 42,
step 1: "columns first, measured").

    python -m benchmarks.flash4_probe [--seqlen 131072] [--columns 1024 4096] [--check-seqlen 2000] --out FILE
    TRITON_INTERPRET=1 python -m benchmarks.flash4_probe --device cpu --seqlen 512 --columns 96 --check-seqlen 384 \
        --heads 2 --kv-heads 1 --head-dim 64        # CPU smoke test: ours and the lists only

Index: ``benchmarks.cases.planted_index`` at block 128 (the kernel results' planted pattern: 64 sinks + random
columns, diagonals of the last 2048 tokens and two 512-token bands at random distances), with ``C`` columns per head
in all (``--columns``: 1024 is the planted 64 + 960, 4096 the estimator's cap), and its slash part alone (no columns,
the row issue 42 measured). flash-attn-4 serves the columns two ways (``benchmarks.flash4.ways``):
"merged" (a second call over the gathered columns, merged by log-sum-exp) and "joined" (one call over K/V expanded to
Hq heads with the columns appended). Every time includes building the lists (ours: ``prepare_index``), as a training
step builds them from a new index; the lists alone are timed too.

Checks: at ``--check-seqlen`` (default 2000, not a multiple of 128) every method against the float64 reference
(``vertical_slash_attention_naive``): out, lse, dq, dk, dv, as max |error| / max |reference|; at the timed length
each flash-attn-4 way against ours. Timing: ``harness.median_ms``; fwd+bwd through autograd from a fixed dout.
"""

from __future__ import annotations

import argparse
import functools
import sys
import traceback

import torch

from benchmarks import harness
from benchmarks.cases import planted_index
from benchmarks.flash4.blocks import column_blocks, column_table, joined_blocks, slash_lists
from ds_mtraining.sparse.index import VerticalSlashIndex
from ds_mtraining.sparse.naive import vertical_slash_attention_naive
from ds_mtraining.sparse.pattern import AttentionPattern

BLOCK = 128


def _flash4():
    """flash-attn-4's ways by name, or {} where it is not installed (CPU, no extra): the table shows n/a."""
    try:
        from benchmarks.flash4 import ways as kernels
    except ImportError as err:
        print(f"flash-attn-4 not available ({err}); its columns read n/a", file=sys.stderr)
        return {}
    return {
        "merged": kernels.merged_attention,
        "joined": kernels.joined_attention,
        "merged, table": functools.partial(kernels.merged_attention, table=True),
        "joined, table": functools.partial(kernels.joined_attention, table=True),
        "hybrid": kernels.hybrid_attention,
        "slash": kernels.slash_attention,
    }


def _ours(q, k, v, index, scale):
    from ds_mtraining.sparse.attention import vertical_slash_attention

    return vertical_slash_attention(q, k, v, AttentionPattern(q.shape[1], index), softmax_scale=scale, return_lse=True)


def _lists(name: str, index: VerticalSlashIndex, n: int) -> object:
    """What the method builds from the index before its kernels run (ours: the kernel form)."""
    if name == "ours":
        from ds_mtraining.sparse.triton.kernel_index import prepare_index

        return prepare_index(index, n)
    if name in ("slash", "hybrid"):
        return slash_lists(index, n)
    cols = joined_blocks(index, n) if name.startswith("joined") else (slash_lists(index, n), column_blocks(index, n))
    positions = cols.columns if name.startswith("joined") else cols[1].positions
    return cols, column_table(index, n, positions) if name.endswith("table") else None


def _slash_only(index: VerticalSlashIndex) -> VerticalSlashIndex:
    empty = torch.empty(*index.vertical.shape[:2], 0, dtype=torch.long, device=index.device)
    return VerticalSlashIndex(empty, index.slash, index.block_size)


def _index(n: int, heads: int, columns: int, device: str) -> VerticalSlashIndex:
    return planted_index(1, heads, n, BLOCK, sinks=min(64, columns), columns=max(columns - 64, 0), device=device)


def _inputs(n, hq, hkv, d, device, dtype, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(1, n, hq, d, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(1, n, hkv, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
    return q, k, v, torch.randn(q.shape, device=device, dtype=dtype, generator=gen)


def _grads(fn, q, k, v, do, index, scale):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out, lse = fn(*leaves, index, scale)
    grads = torch.autograd.grad(out, leaves, do)
    return [out.detach(), lse.detach(), *grads]


def _err(got, ref) -> str:
    return " / ".join(
        f"{(g.double() - r.double()).abs().max().item() / r.abs().max().item():.1e}" for g, r in zip(got, ref)
    )


def check(report, methods, n, hq, hkv, d, columns, device, dtype) -> None:
    """Every method against the float64 reference at a small length."""
    q, k, v, do = _inputs(n, hq, hkv, d, device, dtype, seed=1)
    scale = d**-0.5
    index = _index(n, hq, columns, device)
    ref = _grads(
        lambda q, k, v, i, s: vertical_slash_attention_naive(
            q, k, v, AttentionPattern(n, i), softmax_scale=s, return_lse=True
        ),
        *(x.double() for x in (q, k, v, do)),
        index,
        scale,
    )
    report.add(
        "",
        f"Against the float64 reference, N={n}, {columns} columns a head (max |error| / max |reference|: out / lse / "
        "dq / dk / dv):",
        "",
    )
    for name, fn in methods.items():
        if name == "slash":
            continue
        try:
            report.add(f"- {name}: {_err(_grads(fn, q, k, v, do, index, scale), ref)}")
        except Exception:  # noqa: BLE001 - report the failure, go on with the other methods
            report.add(f"- {name}: FAILED {traceback.format_exc(limit=3).splitlines()[-1]}")
            traceback.print_exc()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=131072)
    parser.add_argument("--columns", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--check-seqlen", type=int, default=2000)
    parser.add_argument("--rep-ms", type=float, default=200.0)
    parser.add_argument("--out")
    harness.add_shape_args(parser)
    harness.add_device_args(parser)
    args = parser.parse_args(argv)
    harness.require_kernels(args.device)
    dtype, gpu = harness.DTYPES[args.dtype], args.device == "cuda"
    n, hq, hkv, d = args.seqlen, args.heads, args.kv_heads, args.head_dim
    report = harness.Report(args.out)
    report.add(
        *harness.header(
            "flash-attn-4 block-sparse vs our kernels on the whole index", __spec__.name, argv, device=args.device,
            packages=("flash-attn-4", "nvidia-cutlass-dsl"),
        ),
        "",
        f"B=1, Hq={hq}, Hkv={hkv}, D={d}, {args.dtype}, block {BLOCK}, planted index; median ms; the speed-up is ours "
        "fwd+bwd / the method's.",
    )  # fmt: skip
    methods = {"ours": _ours, **_flash4()}
    check(report, methods, args.check_seqlen, hq, hkv, d, args.columns[0], args.device, dtype)
    q, k, v, do = _inputs(n, hq, hkv, d, args.device, dtype)
    scale = d**-0.5
    report.add(
        "",
        "| index | density | method | lists ms | fwd ms | fwd+bwd ms | vs ours | vs cuDNN | max err vs ours "
        "(out / lse / dq / dk / dv) |",
        "|" + "---|" * 9,
    )
    dense = float("nan")
    if gpu:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        g = hq // hkv
        qt, kt, vt = q.transpose(1, 2), *(x.transpose(1, 2).repeat_interleave(g, 1) for x in (k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            _, dense = harness.forward_backward_ms(
                lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale),
                [qt, kt, vt], do.transpose(1, 2), rep_ms=args.rep_ms,
            )  # fmt: skip
        report.add(f"| dense | 1.0000 | cuDNN SDPA | - | - | {dense:.2f} | - | 1.00x | - |")
        del qt, kt, vt
    for columns in args.columns:
        full = _index(n, hq, columns, args.device)
        for label, index, names in (
            ("slash only", _slash_only(full), ("ours", "slash")),
            (
                f"slash + {columns} columns",
                full,
                ("ours", "merged", "joined", "merged, table", "joined, table", "hybrid"),
            ),
        ):
            if label == "slash only" and columns != args.columns[0]:
                continue
            density = AttentionPattern(n, index).density().mean().item()
            base = None
            ours_fb = float("nan")
            for name in names:
                fn = methods.get(name)
                if fn is None:
                    report.add(f"| {label} | {density:.4f} | {name} | n/a | n/a | n/a | n/a | n/a | n/a |")
                    continue
                try:
                    got = _grads(fn, q, k, v, do, index, scale)
                    lists = float("nan")
                    if name != "ours" or gpu:
                        lists = harness.median_ms(
                            lambda name=name, index=index: _lists(name, index, n), rep_ms=args.rep_ms
                        )
                    fwd, fb = harness.forward_backward_ms(
                        lambda q, k, v, fn=fn, index=index: fn(q, k, v, index, scale)[0],
                        [q, k, v],
                        do,
                        rep_ms=args.rep_ms,
                    )
                except Exception:  # noqa: BLE001 - report the failure, go on with the other methods
                    report.add(f"| {label} | {density:.4f} | {name} | FAILED: "
                               f"{traceback.format_exc(limit=3).splitlines()[-1][:120]} | | | | | |")  # fmt: skip
                    traceback.print_exc()
                    continue
                if name == "ours":
                    base, ours_fb = got, fb
                    err = "-"
                else:
                    err = _err(got, base) if base is not None else "n/a"
                report.add(
                    f"| {label} | {density:.4f} | {name} | {lists:.2f} | {fwd:.2f} | {fb:.2f} | {ours_fb / fb:.2f}x | "
                    f"{dense / fb:.2f}x | {err} |"
                )
                del got
            if gpu:
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
