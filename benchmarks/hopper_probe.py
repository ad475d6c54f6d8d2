"""The slash inner loop's per-entry speed against cuDNN: today's kernel, a Hopper-featured Triton variant with each
feature a switch, cuDNN and flash-attn-4 on the same work (issue 56, build point 1: "pick the route by a probe").

    python -m benchmarks.hopper_probe --out FILE            # one H100 / H200, bf16: 128K tokens, block 64 and 128
    TRITON_INTERPRET=1 python -m benchmarks.hopper_probe --device cpu --seqlen 512 --doc-len 256 --blocks 64 \
        --check-seqlen 256 --local 128 --band 64 --heads 2 --kv-heads 1 --head-dim 64 --rep-ms 1   # CPU smoke test

Rows, per block size and workload:

- **ours (today)**: ``ds_mtraining.sparse.triton.vertical_slash_forward`` on the slash-only index, its kernel form
  built before timing (as a training step's forward finds it cached);
- **triton ``<spec>``**: ``benchmarks.hopper_kernels.slash_forward`` in the variant the spec names
  (``tma|ptr,m<BLOCK_M>,n<BLOCK_N>,w<warps>,s<stages>[,ws]``: TMA tensor descriptors or pointer loads, rows and keys
  per step, warps, pipeline stages, warp specialisation of the full-block loop). Its step lists are built before
  timing (their build ms is its own column). The row ``ptr`` at today's launch config isolates the step-list walk
  and the in-dot accumulation from the Hopper features; each further row changes one switch;
- **cuDNN SDPA** (``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``, dense causal, K/V repeated to Hq heads as
  ``flash4_probe`` does): the speed reference;
- **flash-attn-4 dense** (``flash_attn.cute``, GQA native) on cuDNN's shapes, where it imports; else the row says
  why not.

Workloads (``--workloads``): ``planted``: B=1, ``--seqlen`` tokens, the planted pattern's slash part
(``benchmarks.cases.planted_index``: the diagonals of the last ``--local`` tokens and two ``--band``-token bands per
head; no columns); cuDNN runs dense causal on the length ``L`` whose causal entries ``Hq L (L + 1) / 2`` are closest
to the sparse workload's attended entries. ``all``: every offset chosen on documents of ``--doc-len`` tokens as a
batch (``--seqlen / --doc-len`` of them), i.e. dense causal attention through the sparse kernels; cuDNN runs on the
very same shapes. This is the "every tile chosen" case of ``2026-12-03-h200-kernel_bound.md`` (0.62 at block 64,
0.70 at block 128 in the forward), rerun here so the new numbers sit next to the recorded ones.

Per-entry speed against cuDNN (the issue's target is >= 0.9; today 0.66-0.73): ``(cuDNN ms / cuDNN's attended
entries) / (method ms / the method's attended entries)``. On ``all`` both do the same entries, and it is exactly
``kernel_bound.md``'s "fraction of cuDNN's speed" (cuDNN ms / ours ms on the same work). On ``planted`` it is the
same ratio per entry; there cuDNN's rows are fewer and longer (L ~ 30K rows a head against 128K), so cuDNN pays less
per-row cost (q loads, the epilogue) per entry than a slash kernel can: read ``all`` as the inner loop's speed and
``planted`` as the target workload's. Attended entries are exact (the causal diagonal tile counts ``bs (bs + 1) / 2``
a tile, as a causal dense row counts ``L (L + 1) / 2``).

Checks: at ``--check-seqlen`` (planted slash pattern scaled down: local band ``N / 4``, far bands ``N / 8``) every
Triton row against the float64 reference of the slash semantics (``hopper_kernels.slash_reference``), as max |error|
/ max |reference| of out / lse; at the timed sizes every variant against ours (same measure).

Forward only. A backward probe would add the dq pass (the same step lists, three products per block) and the dk/dv
pass (the transposed lists: per key block, the query blocks that attend it, full and partial), each with TMA for
q / dO / K / V, the same stage and warp-specialisation switches, cuDNN's backward as the reference and flash-attn-4's
5-product backward as the other bound. It is left out because the forward decides the route: the features a route
must make fast (TMA feeding pipelined wgmma on listed blocks, the online softmax between two GEMMs) are the forward's;
the backward's extra work (atomics-free dk/dv from transposed lists, the delta preprocess) is the same in every
route; and a second set of compiles would not fit the one device call the decision is budgeted for.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback

import torch

from benchmarks import harness
from benchmarks.hopper_kernels import (
    Variant,
    attended_entries,
    build_steps,
    slash_forward,
    slash_index,
    slash_reference,
)
from ds_mtraining.sparse.triton import vertical_slash_forward
from ds_mtraining.sparse.triton.launch_config import launch_config


def default_variants(block_size: int, head_dim: int) -> list[Variant]:
    """The Triton variants timed at a block size unless ``--variants`` names others: today's launch config with
    pointer loads, then with TMA, then one switch at a time (stages, 128-row programs with 8 warps, 64-key steps,
    warp specialisation)."""
    bm, bn, warps, stages = launch_config(torch.bfloat16, block_size, head_dim)["fwd"]
    if block_size == 64:
        specs = [
            f"ptr,m{bm},n{bn},w{warps},s{stages}",
            f"tma,m{bm},n{bn},w{warps},s{stages}",
            f"tma,m{bm},n{bn},w{warps},s4",
            "ptr,m128,n64,w8,s3",
            "tma,m128,n64,w8,s2",
            "tma,m128,n64,w8,s3",
            "tma,m128,n64,w8,s4",
            "tma,m128,n64,w8,s3,ws",
        ]
    else:
        specs = [
            f"ptr,m{bm},n{bn},w{warps},s{stages}",
            f"tma,m{bm},n{bn},w{warps},s{stages}",
            "tma,m128,n128,w8,s2",
            "tma,m128,n64,w8,s3",
            "tma,m128,n64,w8,s4",
            "tma,m128,n128,w8,s3,ws",
            "tma,m128,n64,w8,s3,ws",
        ]
    return [Variant.parse(s) for s in dict.fromkeys(specs)]


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| in float64 (inf where ``got`` is not finite)."""
    got, ref = got.double(), ref.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _inputs(batch, n, hq, hkv, d, device, dtype, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, n, hq, d, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(batch, n, hkv, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
    return q, k, v


def _failed() -> str:
    traceback.print_exc()
    return "FAILED: " + traceback.format_exc(limit=2).strip().splitlines()[-1][:150].replace("|", "/")


def _flash4():
    """flash-attn-4's dense forward, or the reason it is not there."""
    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception as err:  # noqa: BLE001 - ImportError, or a CUDA / cutlass error raised at import
        return None, f"flash_attn.cute does not import ({type(err).__name__}: {str(err)[:80]})".replace("|", "/")
    return flash_attn_func, ""


def dense_length(entries: int, batch: int, heads: int, multiple: int = 128) -> int:
    """The causal length ``L`` (a multiple of ``multiple``) whose entries ``batch * heads * L (L + 1) / 2`` are
    closest to ``entries``."""
    exact = (math.sqrt(1 + 8 * entries / (batch * heads)) - 1) / 2
    lo = max(multiple, int(exact) // multiple * multiple)
    return min((lo, lo + multiple), key=lambda x: abs(batch * heads * x * (x + 1) // 2 - entries))


def check(report: harness.Report, blocks, variants, n, hq, hkv, d, device, dtype) -> None:
    """Every Triton row against the float64 reference at a small length, as a table."""
    report.add(
        "",
        f"Against the float64 reference, N={n}, planted slash pattern (local {n // 4}, bands {n // 8} tokens), B=1 "
        "(max |error| / max |reference|):",
        "",
        "| block | method | out | lse |",
        "|---|---|---|---|",
    )
    q, k, v = _inputs(1, n, hq, hkv, d, device, dtype, seed=1)
    for bs in blocks:
        index = slash_index(1, hq, n, bs, "planted", seed=1, device=device, local=n // 4, band=max(1, n // 8))
        ref = slash_reference(q, k, v, index)
        methods = [("ours (today)", lambda index=index: vertical_slash_forward(q, k, v, index))]
        for var in variants[bs]:
            methods.append(
                (f"triton {var.spec}", lambda var=var, index=index: slash_forward(
                    q, k, v, build_steps(index, n, var.block_m, var.block_n), var))
            )  # fmt: skip
        for name, fn in methods:
            try:
                out, lse = fn()
                report.add(f"| {bs} | {name} | {_err(out, ref[0]):.1e} | {_err(lse, ref[1]):.1e} |")
            except Exception:  # noqa: BLE001 - report the failure, go on with the other methods
                report.add(f"| {bs} | {name} | {_failed()} | |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=131072, help="tokens in all (planted: one row; all: documents)")
    parser.add_argument("--blocks", type=int, nargs="+", default=[64, 128], choices=(64, 128))
    parser.add_argument("--workloads", nargs="+", default=["planted", "all"], choices=("planted", "all"))
    parser.add_argument("--doc-len", type=int, default=8192, help="documents of the 'all' workload")
    parser.add_argument("--local", type=int, default=2048, help="planted: tokens of the local band")
    parser.add_argument("--band", type=int, default=512, help="planted: tokens of each far band")
    parser.add_argument("--variants", nargs="+", help="Triton variant specs (default: default_variants per block)")
    parser.add_argument("--check-seqlen", type=int, default=1024)
    parser.add_argument("--rep-ms", type=float, default=100.0)
    parser.add_argument("--out")
    harness.add_shape_args(parser)
    harness.add_device_args(parser)
    args = parser.parse_args(argv)
    harness.require_kernels(args.device)
    dtype, gpu, device = harness.DTYPES[args.dtype], args.device == "cuda", args.device
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    given = None if args.variants is None else [Variant.parse(s) for s in args.variants]
    variants = {bs: given or default_variants(bs, d) for bs in args.blocks}
    flash4, flash4_why = _flash4() if gpu else (None, "GPU only")
    report = harness.Report(args.out)
    report.add(
        *harness.header(
            "Slash inner loop: today's kernel, Hopper Triton variants, cuDNN, flash-attn-4", __spec__.name, argv,
            device=device, packages=("flash-attn-4", "nvidia-cutlass-dsl"),
        ),
        "",
        f"Hq={hq}, Hkv={hkv}, D={d}, {args.dtype}; forward only; median ms (`harness.median_ms`). Per-entry speed = "
        "(cuDNN ms / cuDNN entries) / (ms / entries); target >= 0.9. Max err = max |x - ours| / max |ours| (out / "
        "lse).",
    )  # fmt: skip
    check(report, args.blocks, variants, args.check_seqlen, hq, hkv, d, device, dtype)
    report.add(
        "",
        "| block | workload | method | ms | attended entries (M) | ms per G entries | per-entry speed vs cuDNN | "
        "max err vs ours (out / lse) | lists ms |",
        "|" + "---|" * 9,
    )
    scale = d**-0.5
    for bs in args.blocks:
        for workload in args.workloads:
            batch, n = (args.seqlen // args.doc_len, args.doc_len) if workload == "all" else (1, args.seqlen)
            label = f"{workload} ({batch} x {harness.tokens(n)})"
            index = slash_index(batch, hq, n, bs, workload, device=device, local=args.local, band=args.band)
            entries = attended_entries(index, n)
            q, k, v = _inputs(batch, n, hq, hkv, d, device, dtype)
            dense_batch, dense_n = (batch, n) if workload == "all" else (1, dense_length(entries, 1, hq))
            dense_entries = dense_batch * hq * dense_n * (dense_n + 1) // 2
            per_entry_dense = float("nan")

            def row(method: str, ms: float, count: int, err: str = "-", lists: str = "-") -> None:
                per_g = ms / count * 1e9
                report.add(
                    f"| {bs} | {label} | {method} | {ms:.3f} | {count / 1e6:.1f} | {per_g:.4f} | "
                    f"{per_entry_dense / per_g:.2f} | {err} | {lists} |"
                )

            # cuDNN (and flash-attn-4) first: the per-entry reference of the rows below.
            if gpu:
                from torch.nn.attention import SDPBackend, sdpa_kernel
                from torch.nn.functional import scaled_dot_product_attention

                dq, dk, dv = _inputs(dense_batch, dense_n, hq, hkv, d, device, dtype, seed=2)
                qt, kt, vt = dq.transpose(1, 2), *(x.transpose(1, 2).repeat_interleave(hq // hkv, 1) for x in (dk, dv))
                try:
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        ms = harness.median_ms(
                            lambda: scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale),
                            rep_ms=args.rep_ms, device=device,
                        )  # fmt: skip
                    per_entry_dense = ms / dense_entries * 1e9
                    row(f"cuDNN SDPA, dense causal {dense_batch} x {dense_n}", ms, dense_entries)
                except Exception:  # noqa: BLE001 - the other rows still have their ms
                    report.add(f"| {bs} | {label} | cuDNN SDPA | {_failed()} | | | | | |")
                del qt, kt, vt
                if flash4 is not None:
                    try:
                        ms = harness.median_ms(
                            lambda: flash4(dq, dk, dv, softmax_scale=scale, causal=True), rep_ms=args.rep_ms,
                            device=device,
                        )  # fmt: skip
                        row(f"flash-attn-4 dense causal {dense_batch} x {dense_n}", ms, dense_entries)
                    except Exception:  # noqa: BLE001
                        report.add(f"| {bs} | {label} | flash-attn-4 dense | {_failed()} | | | | | |")
                del dq, dk, dv
            else:
                report.add(f"| {bs} | {label} | cuDNN SDPA | not run (GPU only) | | | | | |")
            if flash4 is None:
                report.add(f"| {bs} | {label} | flash-attn-4 dense | not run: {flash4_why} | | | | | |")

            kidx = index.kernel_index(n)
            try:
                ours_out, ours_lse = vertical_slash_forward(q, k, v, kidx, scale)
                ms = harness.median_ms(lambda: vertical_slash_forward(q, k, v, kidx, scale), rep_ms=args.rep_ms,
                                       device=device)  # fmt: skip
                row("ours (today)", ms, entries)
            except Exception:  # noqa: BLE001
                report.add(f"| {bs} | {label} | ours (today) | {_failed()} | | | | | |")
                ours_out = ours_lse = None
            for var in variants[bs]:
                name = f"triton {var.spec}"
                try:
                    start = time.perf_counter()
                    steps = build_steps(index, n, var.block_m, var.block_n)
                    harness.sync(device)
                    lists = f"{1e3 * (time.perf_counter() - start):.1f}"
                    out, lse = slash_forward(q, k, v, steps, var, scale)
                    err = "n/a" if ours_out is None else f"{_err(out, ours_out):.1e} / {_err(lse, ours_lse):.1e}"
                    del out, lse
                    ms = harness.median_ms(lambda: slash_forward(q, k, v, steps, var, scale), rep_ms=args.rep_ms,
                                           device=device)  # fmt: skip
                    row(name, ms, entries, err, lists)
                except Exception:  # noqa: BLE001 - a variant Triton rejects (shared memory, warp specialisation)
                    report.add(f"| {bs} | {label} | {name} | {_failed()} | | | | | |")
            del q, k, v, ours_out, ours_lse
            if gpu:
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
