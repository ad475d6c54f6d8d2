"""Packed documents on one GPU: document-masked vertical-slash kernels vs dense varlen and FlexAttention (issue 26).

    python -m benchmarks.packed_bench [--seqlen 131072] [--block-size 64] --out FILE
    python -m benchmarks.packed_bench --device cpu --seqlen 512 --documents 128:0.9 --heads 4 --head-dim 64 \
        --rep-ms 1      # CPU smoke test (the PyTorch path; no FlexAttention)

A row of ``--seqlen`` tokens (default 128K) packed with equal documents (``--documents LENGTH:SPARSITY``, default
8K at 90 % and 32K at 95 % in-document sparsity); B=1, Hq=16, Hkv=2, D=128, bf16, block ``--block-size`` (64, the
config default; ``kernel_bench``'s whole sequences and the 0.6 / density target come from block 128). Each document
gets the same planted vertical-slash pattern (``benchmarks.cases.index_for_density`` for one document's length);
the row's index is its copies shifted to every document (``benchmarks.cases.tiled_index``), so the in-document
density is the pattern's.

Methods, forward and forward + backward (``benchmarks.harness.forward_backward_ms``, do_bench's median):

- **ours**: ``vertical_slash_attention(q, k, v, AttentionPattern(N, index, documents))`` on the packed row;
- **ours, documents as a batch**: the whole-sequence kernels on the documents as a ``[documents, length]`` batch
  with the per-document index: what packing costs over sequences of the documents' length;
- **dense varlen (cuDNN)**: SDPA causal over the documents as a batch (equal lengths make the packed row a
  ``[documents, length]`` batch: the dense varlen attention exactly), cuDNN backend (``benchmarks.baselines``);
- **dense varlen (flex)**: ``vertical_slash_attention(q, k, v, AttentionPattern(N, documents=...))``, FlexAttention with a
  document mask (the project's dense baseline for packed rows);
- **flex, same tiles**: FlexAttention (compiled; GPU only) over the documents as a batch with the block mask
  (``benchmarks.baselines.flex_block_mask``) of the 128-token tiles that cover the per-document pattern's 64-token
  ones.

Checks (out and dq/dk/dv within 2e-2, exit 1 otherwise): ours on the packed row against ours on the documents as a
batch without documents (the whole-sequence kernels, tested against float64), and the dense varlen flex baseline
against cuDNN on the documents as a batch. Target: ours fwd+bwd at least ``0.6 / density`` times faster than dense
varlen cuDNN. On CPU the "kernels" are the PyTorch path and the dense varlen SDPA is PyTorch's choice.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks import harness
from benchmarks.baselines import DENSE_VARLEN_TARGET, as_batch, dense_varlen, flex_block_mask
from benchmarks.cases import document_case, index_for_density, random_row, tiled_index
from ds_mtraining.sparse import AttentionPattern, Documents, VerticalSlashIndex, vertical_slash_attention


def covering_index(index: VerticalSlashIndex) -> VerticalSlashIndex:
    """The index at twice the block size that covers every entry of ``index``: a block offset ``s`` between blocks
    ``i`` and ``j`` lands at ``i // 2 - j // 2``, which is ``s // 2`` or ``(s + 1) // 2``."""
    slash = index.slash
    coarse = torch.cat([slash // 2, torch.where(slash >= 0, (slash + 1) // 2, -1)], -1)
    return VerticalSlashIndex.build(index.vertical, coarse, 2 * index.block_size)


def run_case(args: argparse.Namespace, length: int, sparsity: float) -> str:
    """The table's row of one document length: the checks (exit 1 on a failure), then the timings."""
    n, bs, hq, d = args.seqlen, args.block_size, args.heads, args.head_dim
    device, gpu = args.device, args.device == "cuda"
    docs = n // length
    leaves, do = random_row(n, hq, args.kv_heads, d, device=device, dtype=harness.DTYPES[args.dtype])
    per_doc, density = index_for_density(1, hq, length, bs, 1 - sparsity, device=device)
    documents = Documents.from_document_ids((torch.arange(n, device=device) // length)[None])
    pattern = AttentionPattern(n, tiled_index(per_doc, length, docs), documents)
    dense = AttentionPattern(n, documents=documents)
    batch_pattern = AttentionPattern(
        length, VerticalSlashIndex.build(per_doc.vertical.expand(docs, -1, -1), per_doc.slash.expand(docs, -1, -1), bs)
    )

    def ours(q, k, v):
        return vertical_slash_attention(q, k, v, pattern, check_index=False)

    def ours_as_batch(q, k, v):
        out = vertical_slash_attention(*(as_batch(x, length) for x in (q, k, v)), batch_pattern, check_index=False)
        return out.reshape(1, n, hq, d)

    def cudnn(q, k, v):
        return dense_varlen(q, k, v, length)

    def flex_dense(q, k, v):
        return vertical_slash_attention(q, k, v, dense, check_index=False)

    # At block 64 flex gets the 128-token tiles that cover our 64-token ones: its forward's default tile is 128
    # rows, which must divide the mask's blocks, and torch 2.11's backward rejects 64-token blocks even with its
    # tiles set to 64 (NoValidChoicesError; pytorch/pytorch#176025, fixed after 2.11).
    block_mask, tiles = flex_block_mask(per_doc if bs >= 128 else covering_index(per_doc), length)

    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)

    def flex_tiles(q, k, v):
        qb, kb, vb = (as_batch(x, length).transpose(1, 2) for x in (q, k, v))
        out = flex(qb, kb, vb, block_mask=block_mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(1, n, hq, d)

    def forward_backward(fn):
        out = fn(*leaves)
        return [out.detach(), *torch.autograd.grad(out, leaves, do)]

    errors = []
    for label, fn, reference in (("ours", ours, ours_as_batch), ("flex dense", flex_dense, cudnn)):
        got, want = forward_backward(fn), forward_backward(reference)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            rel = float((a.float() - b.float()).norm() / b.float().norm())
            errors.append(f"{label} {name} {rel:.1e}")
            if rel > 2e-2:
                raise SystemExit(f"{label} on the packed row differs from the documents as a batch: {name} {rel:.2e}")

    times = {}
    methods = (("ours", ours), ("ours as batch", ours_as_batch), ("cudnn", cudnn), ("flex dense", flex_dense),
               ("flex tiles", flex_tiles if gpu else None))  # fmt: skip
    for name, fn in methods:
        if fn is None:
            times[name] = "not run (GPU only)"
            continue
        try:
            times[name] = harness.forward_backward_ms(fn, leaves, do, rep_ms=args.rep_ms)
        except Exception as error:  # a baseline that fails is reported in its cell; ours (both) and cuDNN must run
            if name in ("ours", "ours as batch", "cudnn"):
                raise
            times[name] = "failed"
            print(
                f"{name} failed at {harness.tokens(length)} documents: {type(error).__name__}: {error}", file=sys.stderr
            )
    speedup = times["cudnn"][1] / times["ours"][1]
    packing = times["ours"][1] / times["ours as batch"][1]  # 1.0: the whole-sequence kernels' efficiency
    target = DENSE_VARLEN_TARGET / density
    return (
        f"| {harness.tokens(n)} | {bs} | {harness.tokens(length)} x {docs} | {density:.3f} | {tiles:.3f} | "
        + " | ".join(t if isinstance(t, str) else f"{t[0]:.2f} / {t[1]:.2f}" for t in times.values())
        + f" | {packing:.2f} | {speedup:.2f}x | {target:.1f}x | {'met' if speedup >= target else 'not met'} | "
        + f"{', '.join(errors)} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=1 << 17)
    parser.add_argument("--documents", type=document_case, nargs="+", default=[(8192, 0.90), (32768, 0.95)],
                        help="LENGTH:SPARSITY of each case's equal documents")  # fmt: skip
    parser.add_argument(
        "--block-size", type=int, choices=[64, 128], default=64,
        help="the index's block size (64: the config default; the whole-sequence kernel_bench runs at 128)",
    )  # fmt: skip
    parser.add_argument("--rep-ms", type=float, default=200.0, help="timed milliseconds per measurement")
    parser.add_argument("--out")
    harness.add_shape_args(parser)
    harness.add_device_args(parser)
    args = parser.parse_args(argv)
    report = harness.Report(args.out)
    report.add(
        *harness.header("Packed documents: sparse kernels vs dense varlen", __spec__.name, argv, device=args.device),
        "",
        (
            f"Hq={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}, {args.dtype}; ms as forward / forward + "
            "backward; speedup = dense varlen cuDNN fwd+bwd / ours fwd+bwd; packed / batch = ours fwd+bwd on the "
            "packed row / ours on the documents as a batch (the whole-sequence kernels)"
        ),
        "",
        (
            "| row | block | documents | in-doc density | flex tiles | ours | ours, documents as a batch | "
            "dense varlen cuDNN | dense varlen flex | flex same tiles | packed / batch | speedup | "
            f"target {DENSE_VARLEN_TARGET}/density | target | checks (rel. error vs batch) |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    )
    for length, sparsity in args.documents:
        report.add(run_case(args, length, sparsity))
    return 0


if __name__ == "__main__":
    sys.exit(main())
