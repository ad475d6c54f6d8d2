"""Packed documents on one GPU: document-masked vertical-slash kernels vs dense varlen and FlexAttention (issue 26).

A row of ``--seqlen`` tokens (default 128K) packed with equal documents of 8K and of 32K tokens; B=1, Hq=16,
Hkv=2, D=128, bf16, block ``--block-size`` (64, the config default; ``kernel_bench``'s whole sequences and the
0.6 / density target come from block 128). Each document gets the same planted vertical-slash pattern
(``kernel_bench``'s ``index_for_density`` for one document's length, at 90 % in-document sparsity for 8K documents
and 95 % for 32K ones); the row's index is its copies shifted to every document (columns moved by the document
start, offsets unchanged), so the in-document density is the pattern's.

Methods, forward and forward + backward (``triton.testing.do_bench``, median):

- **ours**: ``vertical_slash_attention(q, k, v, index, documents=...)`` on the packed row;
- **ours, documents as a batch**: the whole-sequence kernels on the documents as a ``[documents, length]`` batch
  with the per-document index: what packing costs over sequences of the documents' length;
- **dense varlen (cuDNN)**: SDPA causal over the documents as a batch (equal lengths make the packed row a
  ``[documents, length]`` batch: the dense varlen attention exactly), cuDNN backend;
- **dense varlen (flex)**: ``vertical_slash_attention(q, k, v, None, documents=...)``, FlexAttention with a
  document mask (the project's dense baseline for packed rows);
- **flex, same tiles**: FlexAttention over the documents as a batch with the block mask
  (``kernel_bench.flex_block_mask``) of the 128-token tiles that cover the per-document pattern's 64-token ones.

Checks (out and dq/dk/dv within bf16 tolerance): ours on the packed row against ours on the documents as a batch
without documents (the whole-sequence kernels, tested against float64), and the dense varlen flex baseline against
cuDNN on the documents as a batch. Target: ours fwd+bwd at least
``0.6 / density`` times faster than dense varlen cuDNN.

Usage: python benchmarks/packed_bench.py [--seqlen 131072] [--block-size 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from kernel_bench import bench, flex_block_mask, index_for_density  # this directory is on sys.path as a script

from ds_mtraining.sparse import Documents, VerticalSlashIndex, vertical_slash_attention

HQ, HKV, D = 16, 2, 128
CASES = ((8192, 0.90), (32768, 0.95))  # (document length, in-document sparsity)
TARGET_FRACTION = 0.6  # the target: fwd+bwd TARGET_FRACTION / density times faster than cuDNN


def tiled_index(per_document: VerticalSlashIndex, length: int, documents: int) -> VerticalSlashIndex:
    """The per-document index repeated over ``documents`` documents of ``length`` tokens: ``[B, Hq, ·]``."""
    vertical = per_document.vertical
    shifted = [torch.where(vertical >= 0, vertical + d * length, -1) for d in range(documents)]
    return VerticalSlashIndex.build(torch.cat(shifted, -1), per_document.slash, per_document.block_size)


def covering_index(index: VerticalSlashIndex) -> VerticalSlashIndex:
    """The index at twice the block size that covers every entry of ``index``: a block offset ``s`` between blocks
    ``i`` and ``j`` lands at ``i // 2 - j // 2``, which is ``s // 2`` or ``(s + 1) // 2``."""
    slash = index.slash
    coarse = torch.cat([slash // 2, torch.where(slash >= 0, (slash + 1) // 2, -1)], -1)
    return VerticalSlashIndex.build(index.vertical, coarse, 2 * index.block_size)


def timed(fn, leaves, do):
    """(forward ms, forward + backward ms) of ``fn(*leaves)``."""
    detached = [x.detach() for x in leaves]
    with torch.no_grad():
        fwd = bench(lambda: fn(*detached))

    def fwd_bwd():
        torch.autograd.grad(fn(*leaves), leaves, do)

    return fwd, bench(fwd_bwd)


def as_batch(x: torch.Tensor, length: int) -> torch.Tensor:
    """``[1, N, H, D]`` -> ``[N / length, length, H, D]``: equal documents as a batch."""
    return x.reshape(-1, length, *x.shape[2:])


def random_row(n: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Leaves q ``[1, n, Hq, D]``, k / v ``[1, n, Hkv, D]`` (bf16, CUDA, requiring grad, seed 0) and the output's
    gradient ``do`` like q."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, n, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, n, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    return [x.requires_grad_() for x in (q, k, v)], torch.randn_like(q)


def dense_varlen_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int) -> torch.Tensor:
    """Causal SDPA (cuDNN backend) over a row of equal documents of ``length`` tokens taken as a batch, which is
    the dense varlen attention exactly: q ``[1, N, Hq, D]``, k / v ``[1, N, Hkv, D]`` -> ``[1, N, Hq, D]``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qb, kb, vb = (as_batch(x, length).transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).reshape(q.shape)


def run_header(block_size: int | None = None) -> str:
    """The results' first line: GPU, torch and Triton versions, the block size if given, the command."""
    import triton

    block = "" if block_size is None else f"block {block_size} · "
    return (
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · Triton {triton.__version__} · {block}"
        f"command: `python {' '.join(sys.argv)}`"
    )


def run_case(n: int, length: int, sparsity: float, bs: int) -> tuple[str, list[str]]:
    docs = n // length
    leaves, do = random_row(n)
    per_doc, density = index_for_density(1, HQ, length, bs, 1 - sparsity)
    index = tiled_index(per_doc, length, docs)
    documents = Documents.from_document_ids((torch.arange(n, device="cuda") // length)[None])
    batch_index = VerticalSlashIndex.build(
        per_doc.vertical.expand(docs, -1, -1), per_doc.slash.expand(docs, -1, -1), bs
    )

    def ours(q, k, v):
        return vertical_slash_attention(q, k, v, index, documents=documents, check_index=False)

    def ours_as_batch(q, k, v):
        out = vertical_slash_attention(*(as_batch(x, length) for x in (q, k, v)), batch_index, check_index=False)
        return out.reshape(1, n, HQ, D)

    def cudnn(q, k, v):
        return dense_varlen_cudnn(q, k, v, length)

    def flex_dense(q, k, v):
        return vertical_slash_attention(q, k, v, None, documents=documents, check_index=False)

    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    # At block 64 flex gets the 128-token tiles that cover our 64-token ones: its forward's default tile is 128
    # rows, which must divide the mask's blocks, and torch 2.11's backward rejects 64-token blocks even with its
    # tiles set to 64 (NoValidChoicesError; pytorch/pytorch#176025, fixed after 2.11).
    block_mask, tiles = flex_block_mask(per_doc if bs >= 128 else covering_index(per_doc), length)

    def flex_tiles(q, k, v):
        qb, kb, vb = (as_batch(x, length).transpose(1, 2) for x in (q, k, v))
        out = flex(qb, kb, vb, block_mask=block_mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(1, n, HQ, D)

    # Checks, forward and backward: ours on the packed row equals ours on the documents as a batch, and the dense
    # varlen baseline (FlexAttention's document mask) equals cuDNN on the documents as a batch.
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
               ("flex tiles", flex_tiles))  # fmt: skip
    for name, fn in methods:
        try:
            times[name] = timed(fn, leaves, do)
        except Exception as error:  # a baseline that fails is reported in its cell; ours (both) and cuDNN must run
            if name in ("ours", "ours as batch", "cudnn"):
                raise
            times[name] = None
            print(f"{name} failed at {length // 1024}K documents: {type(error).__name__}: {error}", file=sys.stderr)
    speedup = times["cudnn"][1] / times["ours"][1]
    packing = times["ours"][1] / times["ours as batch"][1]  # 1.0: the whole-sequence kernels' efficiency
    target = TARGET_FRACTION / density
    row = (
        f"| {n // 1024}K | {bs} | {length // 1024}K x {docs} | {density:.3f} | {tiles:.3f} | "
        + " | ".join("failed" if t is None else f"{t[0]:.2f} / {t[1]:.2f}" for t in times.values())
        + f" | {packing:.2f} | {speedup:.2f}x | {target:.1f}x | {'met' if speedup >= target else 'not met'} | "
        + f"{', '.join(errors)} |"
    )
    return row, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=1 << 17)
    parser.add_argument(
        "--block-size", type=int, choices=[64, 128], default=64,
        help="the index's block size (64: the config default; the whole-sequence kernel_bench.py runs at 128)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("packed_bench.py measures the Triton kernels: it needs a CUDA GPU")
    lines = [
        run_header(),
        "",
        (
            "ms as forward / forward + backward; speedup = dense varlen cuDNN fwd+bwd / ours fwd+bwd; packed / batch = "
            "ours fwd+bwd on the packed row / ours on the documents as a batch (the whole-sequence kernels)"
        ),
        "",
        (
            "| row | block | documents | in-doc density | flex tiles | ours | ours, documents as a batch | "
            "dense varlen cuDNN | dense varlen flex | flex same tiles | packed / batch | speedup | "
            f"target {TARGET_FRACTION}/density | target | checks (rel. error vs batch) |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for length, sparsity in CASES:
        row, _ = run_case(args.seqlen, length, sparsity, args.block_size)
        print(row, flush=True)
        lines.append(row)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
