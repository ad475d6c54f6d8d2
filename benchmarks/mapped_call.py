"""What tile maps cost the Triton kernels: one device's problem run as one device runs it, and through identity tile
maps (what a ring of one runs), per pass (issue 53).

    python -m benchmarks.mapped_call --seqlen 262144 --out F.md
    TRITON_INTERPRET=1 python -m benchmarks.mapped_call --device cpu --seqlen 512 --heads 4 --head-dim 64  # smoke

Every ring step runs the kernels with tile maps (``MAPPED``); a ring's overhead over the one-device kernels
(``benchmarks.ring_steps``) mixes what the maps cost each call with what the ring's shape costs (more, smaller
calls). Identity maps on the whole sequence separate the first. Then the maps place every tile where one device
has it, and the results are the one-device call's. Three calls on the same inputs (the planted pattern of
``ring_steps``):

- ``one device``: ``vertical_slash_forward`` / ``vertical_slash_backward`` without maps;
- ``maps``: the same with identity ``TileMap``s for q and k/v;
- ``maps + merge`` (forward only): merged into a running fp32 out / lse, as every ring step does.

Reported: each call's median ms and, from ``torch.profiler``, each kernel's device time (CPU: the operators' self
time, which says nothing of the GPU). On a GPU also each compiled kernel's registers and spills per variant (Triton's
``n_regs`` / ``n_spills``, read from the kernels' compile caches where this Triton keeps them), which is where a
constexpr flag that adds little code can still cost a pass its occupancy.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch

from benchmarks import harness, ring_kernels, ring_steps


def kernel_resources() -> list[tuple[str, str, int, int]]:
    """``(kernel, MAPPED or not, registers, spills)`` of every sparse kernel compiled so far in this process, from
    the Triton JIT functions' compile caches (empty where this Triton keeps them elsewhere, or under the
    interpreter)."""
    from ds_mtraining.sparse.triton import backward_dkdv, backward_dq, forward

    rows = []
    for fn in (forward._fwd_kernel, backward_dq._bwd_dq_kernel, backward_dkdv._bwd_col_kernel,
               backward_dkdv._bwd_dkdv_kernel):  # fmt: skip
        position = (fn.arg_names.index("MAPPED"),)  # Triton keys a kernel's constants by argument position
        for caches in getattr(fn, "device_caches", {}).values():
            for kernel in caches[0].values():
                constants = getattr(getattr(kernel, "src", None), "constants", {}) or {}
                mapped = constants.get(position, "?")
                rows.append((fn.__name__, str(mapped), getattr(kernel, "n_regs", -1), getattr(kernel, "n_spills", -1)))
    return sorted(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mapped_call", description=__doc__.split("\n\n")[0])
    harness.add_device_args(parser)
    harness.add_shape_args(parser)
    parser.add_argument("--seqlen", type=int, default=262144)
    parser.add_argument("--density", type=float, default=0.05, help="planted pattern's density")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rep-ms", type=float, default=300.0, help="timed milliseconds per call")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    harness.require_kernels(args.device)
    from ds_mtraining.sparse.triton import prepare_tile_map, vertical_slash_backward, vertical_slash_forward

    args.pattern = "planted"
    dtype = harness.DTYPES[args.dtype]
    index = ring_steps.make_pattern(args, args.seqlen).index
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    n, hq, hkv, d = args.seqlen, args.heads, args.kv_heads, args.head_dim
    q, do = (torch.randn(1, n, hq, d, generator=gen).to(args.device, dtype) for _ in range(2))
    k, v = (torch.randn(1, n, hkv, d, generator=gen).to(args.device, dtype) for _ in range(2))
    kidx = index.kernel_index(n)
    identity = prepare_tile_map(torch.arange(kidx.num_blocks, device=args.device), kidx.num_blocks)
    maps = {"q_blocks": identity, "kv_blocks": identity}
    out, lse = vertical_slash_forward(q, k, v, kidx)
    running = (torch.zeros(q.shape, device=args.device), torch.full((1, hq, n), -torch.inf, device=args.device))
    calls: dict[str, tuple[str, Callable[[], object]]] = {
        "forward, one device": ("forward", lambda: vertical_slash_forward(q, k, v, kidx)),
        "forward, maps": ("forward", lambda: vertical_slash_forward(q, k, v, kidx, **maps)),
        "forward, maps + merge": (
            "forward", lambda: vertical_slash_forward(q, k, v, kidx, out=running[0], lse=running[1], **maps)
        ),
        "backward, one device": ("backward", lambda: vertical_slash_backward(do, q, k, v, out, lse, kidx)),
        "backward, maps": ("backward", lambda: vertical_slash_backward(do, q, k, v, out, lse, kidx, **maps)),
    }  # fmt: skip
    # The maps place every tile where one device has it: the same results, or the timings compare different work.
    got = (*vertical_slash_forward(q, k, v, kidx, **maps), *vertical_slash_backward(do, q, k, v, out, lse, kidx, **maps))
    want = (out, lse, *vertical_slash_backward(do, q, k, v, out, lse, kidx))
    errors = [float((x.double() - y.double()).abs().max() / y.double().abs().max().clamp(min=1e-30))
              for x, y in zip(got, want)]  # fmt: skip
    if max(errors) > 1e-2:
        raise SystemExit(f"identity maps changed the result (max relative error {max(errors):.2g}): not timed")
    report = harness.Report(args.out)
    report.add(
        *harness.header("Tile maps in the Triton kernels: one device against identity maps", __spec__.name, argv,
                        device=args.device),  # fmt: skip
        "",
        f"B=1, Hq={hq}, Hkv={hkv}, D={d}, {args.dtype}, block {ring_steps.BLOCK}, {n} tokens; planted pattern "
        f"(density {args.density}); median ms of each call, then each kernel's device time (profiler, mean of "
        f"{ring_kernels.CALLS} calls).",
        f"Identity maps against one device, max |difference| / max |one device| (out, lse, dq, dk, dv): "
        + ", ".join(f"{e:.1e}" for e in errors),
        "",
        "| call | ms | over one device | kernels (ms) |",
        "|---|---|---|---|",
    )
    base: dict[str, float] = {}
    for name, (direction, fn) in calls.items():
        ms = harness.median_ms(fn, rep_ms=args.rep_ms, device=args.device)
        base.setdefault(direction, ms)
        times = ring_kernels.KernelTimes(args.device)
        times(fn, direction)
        kernels = sorted(times.totals[direction].items(), key=lambda kv: -kv[1])[:4]
        listed = ", ".join(f"{key[:40]} {t:.2f}" for key, t in kernels)
        report.add(f"| {name} | {ms:.2f} | {ms / base[direction]:.2f} | {listed} |")
    resources = kernel_resources()
    if resources:
        report.add("", "| kernel | MAPPED | registers | spills |", "|---|---|---|---|")
        report.add(*(f"| {name} | {mapped} | {regs} | {spills} |" for name, mapped, regs, spills in resources))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
