"""Dense causal attention's kernels side by side: the measurements behind ``sparse.dense.DENSE_ORDER`` (issue 56,
point 3).

    python -m benchmarks.dense_kernels --seqlens 32768 131072 --out F.md
    python -m benchmarks.dense_kernels --device cpu --seqlens 256 --check-seqlen 100 --heads 4 --kv-heads 2  # smoke

Each kernel installed for the device (on CUDA: SDPA restricted to cuDNN and to FlashAttention-2 (its memory-efficient
kernel takes no GQA), and flash-attn-4 where ``flash_attn.cute`` imports; everywhere: ``dense_causal_attention``,
the project's choice) is first checked against the float64 definition (``vertical_slash_attention_naive`` without a
pattern) at ``--check-seqlen``, not a multiple of the kernels' tiles: out, dq, dk and dv as max |error| / max
|reference|. A kernel whose error is above ``TOLERANCE`` is reported and not timed. Then forward and forward +
backward (``harness.forward_backward_ms``) at each length; the ratio is cuDNN's time over the kernel's (on CPU,
over the first row's).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks import harness
from ds_mtraining.sparse import dense
from ds_mtraining.sparse.naive import vertical_slash_attention_naive

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
"""Max |error| / max |reference| a kernel may show in out, dq, dk or dv (a wrong mask or scale gives O(1))."""

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def _sdpa(backend: SDPBackend) -> Kernel:
    def attend(q, k, v, scale):
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=True
            )
        return out.transpose(1, 2)

    return attend


def _flash_attn_4(q, k, v, scale):
    return dense._flash_attn_4()(q, k, v, softmax_scale=scale, causal=True)[0]


def kernels(device: str) -> dict[str, Kernel]:
    """The kernels to compare on ``device``, by name; the project's choice last."""
    found: dict[str, Kernel] = {}
    if device == "cuda":
        found |= {
            "SDPA cuDNN": _sdpa(SDPBackend.CUDNN_ATTENTION),
            "SDPA FlashAttention-2": _sdpa(SDPBackend.FLASH_ATTENTION),
        }
        if dense._flash_attn_4() is not None:
            found["flash-attn-4"] = _flash_attn_4
    found["dense_causal_attention"] = dense.dense_causal_attention
    return found


def _inputs(n: int, args, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q, kv = (1, n, args.heads, args.head_dim), (1, n, args.kv_heads, args.head_dim)
    shapes = [q, kv, kv, q]  # q, k, v, dout
    return [torch.randn(s, generator=gen).to(args.device, dtype) for s in shapes]


def errors(kernel: Kernel, args, dtype: torch.dtype) -> list[float]:
    """max |error| / max |reference| of out, dq, dk, dv against the float64 definition at ``--check-seqlen``."""
    q, k, v, dout = _inputs(args.check_seqlen, args, dtype, args.seed)
    scale = args.head_dim**-0.5
    results = []
    for fn, cast in ((kernel, dtype), (vertical_slash_attention_naive, torch.float64)):
        leaves = [x.detach().to(cast).requires_grad_() for x in (q, k, v)]
        out = fn(*leaves, scale) if fn is kernel else fn(*leaves, None, softmax_scale=scale)
        results.append([out, *torch.autograd.grad(out, leaves, dout.to(cast))])
    return [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(*results)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dense_kernels", description=__doc__.split("\n\n")[0])
    harness.add_device_args(parser)
    harness.add_shape_args(parser)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--check-seqlen", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rep-ms", type=float, default=200.0, help="timed milliseconds per measurement")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    dtype = harness.DTYPES[args.dtype]
    report = harness.Report(args.out)
    report.add(
        *harness.header("Dense causal attention kernels", __spec__.name, argv, device=args.device,
                        packages=("flash-attn-4", "nvidia-cutlass-dsl")),  # fmt: skip
        "",
        f"B 1, Hq {args.heads}, Hkv {args.kv_heads}, D {args.head_dim}, {args.dtype}; the project's choice here: "
        f"`{dense.dense_kernel(torch.device(args.device), dtype, args.head_dim)}`",
        "",
        f"## Against float64 at N = {args.check_seqlen} (out / dq / dk / dv; tolerance {TOLERANCE[dtype]:g})",
        "",
        "| kernel | errors | passes |",
        "|---|---|---|",
    )
    found, passed = kernels(args.device), {}
    for name, kernel in found.items():
        try:
            errs = errors(kernel, args, dtype)
        except Exception as err:  # a backend that does not take this dtype / shape on this device
            report.add(f"| {name} | not run: {type(err).__name__}: {str(err).splitlines()[0][:120]} | - |")
            continue
        ok = max(errs) <= TOLERANCE[dtype]
        report.add(f"| {name} | {' / '.join(f'{e:.1e}' for e in errs)} | {'yes' if ok else '**no**'} |")
        if ok:
            passed[name] = kernel
    report.add("", "## Times (ms)", "", "| N | kernel | fwd | fwd + bwd | vs first (fwd + bwd) |", "|" + "---|" * 5)
    scale = args.head_dim**-0.5
    for n in args.seqlens:
        q, k, v, dout = _inputs(n, args, dtype, args.seed)
        first = None
        for name, kernel in passed.items():
            fwd, both = harness.forward_backward_ms(
                lambda q, k, v, kernel=kernel: kernel(q, k, v, scale), [q, k, v], dout, rep_ms=args.rep_ms
            )
            first = first or both
            report.add(f"| {n} | {name} | {fwd:.2f} | {both:.2f} | {first / both:.2f}x |")
    return 0 if len(passed) == len(found) else 1


if __name__ == "__main__":
    raise SystemExit(main())
