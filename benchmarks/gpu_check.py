"""GPU correctness of the vertical-slash Triton kernels (bf16 unless noted), printed as a table; exit 1 on failure.

Checks, each a relative error ||x - ref|| / ||ref|| (Frobenius) of out, lse, dq, dk, dv:

1. Small N (<= 2K, several shapes: bs 64/128, D 64/128, GQA/MQA (groups of 1, 2, 3 and 8), N not a multiple of bs,
   random / no-column / dense indices; bf16, plus one fp16 and one fp32 case (fp32 dots run as tf32)): against the float64 reference (``reference_attention`` on the dense mask, autograd for the
   gradients), inputs the same bf16 values. Pass: error <= 2 x the error of the same reference computed in bf16
   (fp16 / fp32) by PyTorch (the same-precision baseline) + 2e-3 (fp32: the kernels' dots are tf32, which
   PyTorch's fp32 reference is not, so only the 5e-3 cap applies), and <= 5e-3 (bf16 flash kernels land near 2.5e-3, cuDNN's
   error in check 4; PyTorch's all-bf16 baseline is worse, ~1.2e-2, so the absolute cap is what binds).
2. Merge into a running (out, lse): two forward calls over disjoint key sets (two K/V tensors, two indices)
   merged in place against one float64 softmax over their union.
3. Large N (32K and 128K; planted index of docs/design.md, Hq=16, Hkv=2, D=128, bs=128): no N x N reference
   fits, so rows and columns are sampled. out, lse, dq at 192 sampled query rows (random, the first and last
   tiles, the partial last rows) against an fp32 PyTorch computation of those rows over all N keys with the
   index's mask (attend rule evaluated per entry). dk, dv at 96 sampled key positions (sink columns, vertical
   columns, random keys, the last key) against an fp32 computation over all N query rows of the kv head's
   group, using the kernel's lse and delta = rowsum(dO * O) (both verified on the sampled rows). Pass: <= 5e-3
   for out / dq / dk / dv, 1e-3 for lse (bf16 operands; P is rounded to bf16 before PV and dS before the dK/dQ
   products, as in FlashAttention).
4. Dense index at N=8K against fp32 SDPA (math backend, upcast inputs), next to cuDNN SDPA in bf16 against
   the same reference. Pass: error <= 2 x cuDNN's + 2e-3.
4b. The dense layer path, ``vertical_slash_attention(index=None)`` (SDPA, cuDNN first: ``DENSE_BACKENDS``), under
   autograd at N=4K with 16 / 2 heads of 128 against the float64 reference: out, dq, dk, dv, limits as in 1; the
   kernel SDPA ran is named in the baseline column.
5. Determinism at 128K: two forward and two backward runs, bitwise identical.
6. Ring shards (tile maps) at N=8K: the sequence cut into the 2 shards of a striped layout (block 64, a
   planted index converted once for the whole sequence and cached on it, ``TileMap`` per shard), every (query
   shard, K/V shard) pair as a ring step runs it — own shard first, merged into a running fp32 (out, lse) —, then the
   backward of each pair with the merged rows. Against ``torch_path`` on the same pairs and block ids (fp32
   compute from the same bf16 inputs): out / lse after each merge, dq / dk / dv of each pair. Pass: 5e-3
   (lse 1e-3), as in 1: the kernels' own bf16 error against an fp32 computation.
7. ``torch.compile`` at N=8K (planted index): ``vertical_slash_attention`` compiled with ``fullgraph=True`` traces
   with no graph break (the launchers are ``torch.library`` custom ops), and its out / dq / dk / dv are bitwise
   equal to eager's (the ops are opaque to Inductor, so the same kernels run).

Usage: python benchmarks/gpu_check.py [--out FILE] [--checks NAME ...]   (all: about 3 minutes on an H200)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_bench import planted_index

from ds_mtraining.parallel.layout import make_layout
from ds_mtraining.sparse import torch_path
from ds_mtraining.sparse import triton as vs
from ds_mtraining.sparse.index import VerticalSlashIndex, index_to_dense_mask
from ds_mtraining.sparse.reference import reference_attention

DEV = "cuda"
DTYPE = torch.bfloat16  # the checked precision (the script is smoke-tested on CPU in fp32)
ROWS: list[str] = []
FAILED: list[str] = []


def rel(x, ref):
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def record(case, name, err, limit, extra=""):
    ok = err <= limit
    ROWS.append(f"| {case} | {name} | {err:.2e} | {limit:.2e} | {extra} | {'ok' if ok else 'FAIL'} |")
    print(ROWS[-1], flush=True)
    if not ok:
        FAILED.append(f"{case} {name}")


def random_index(b, h, n, bs, cols, offs, gen):
    nb = -(-n // bs)
    vertical = torch.randint(0, n, (b, h, cols), generator=gen)
    slash = torch.randint(0, nb, (b, h, offs), generator=gen)
    return VerticalSlashIndex.build(vertical.to(DEV), slash.to(DEV), bs)


def reference(q, k, v, mask, scale, do, dtype):
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out, lse = reference_attention(*leaves, mask, scale)
    out.backward(do.to(dtype))
    return [out.detach(), lse.detach()] + [x.grad for x in leaves]


def check_small():
    gen = torch.Generator().manual_seed(0)
    shapes = [  # b, n, hq, hkv, d, bs, kind, dtype
        (2, 1000, 4, 2, 64, 64, "random", DTYPE),
        (2, 2048, 4, 2, 128, 128, "random", DTYPE),
        (1, 1999, 8, 1, 128, 128, "random", DTYPE),
        (2, 777, 4, 4, 64, 64, "no-columns", DTYPE),
        (1, 1500, 4, 2, 128, 64, "dense", DTYPE),
        (1, 1300, 4, 2, 128, 128, "random", torch.float16),
        (1, 1300, 4, 2, 128, 128, "random", torch.float32),
        (1, 2048, 9, 3, 64, 64, "random", DTYPE),  # SmolLM2-135M's heads (groups of 3) at an evaluation length
    ]
    for b, n, hq, hkv, d, bs, kind, dtype in shapes:
        q, k, v, do = (torch.randn(b, n, h, d, generator=gen).to(DEV, dtype) for h in (hq, hkv, hkv, hq))
        if kind == "dense":
            index = VerticalSlashIndex.dense(b, hq, n, bs, device=DEV)
        elif kind == "no-columns":
            index = VerticalSlashIndex.build(
                torch.empty(b, hq, 0, dtype=torch.long, device=DEV), random_index(b, hq, n, bs, 1, 3, gen).slash, bs
            )
        else:
            index = random_index(b, hq, n, bs, 200, 4, gen)
        scale = d**-0.5
        out, lse = vs.vertical_slash_forward(q, k, v, index, scale)
        got = [out, lse, *vs.vertical_slash_backward(do, q, k, v, out, lse, index, scale)]
        mask = index_to_dense_mask(index, n)
        ref = reference(q, k, v, mask, scale, do, torch.float64)
        base = reference(q, k, v, mask, scale, do, dtype)
        case = f"small B={b} N={n} Hq={hq} Hkv={hkv} D={d} bs={bs} {kind} {str(dtype)[6:]}"
        for name, x, r, bl in zip(["out", "lse", "dq", "dk", "dv"], got, ref, base):
            eb = rel(bl, r)
            # fp32 inputs run their dots as tf32 (10-bit mantissa, ~2e-3 here): judged by the absolute cap only.
            limit = 5e-3 if dtype == torch.float32 else min(2 * eb + 2e-3, 5e-3)
            record(case, name, rel(x, r), limit, f"torch same dtype: {eb:.2e}")


def check_merge():
    gen = torch.Generator().manual_seed(1)
    b, n, hq, hkv, d, bs = 2, 1100, 4, 2, 128, 64
    q = torch.randn(b, n, hq, d, generator=gen).to(DEV, DTYPE)
    kvs = [[torch.randn(b, n, hkv, d, generator=gen).to(DEV, DTYPE) for _ in range(2)] for _ in range(2)]
    idxs = [random_index(b, hq, n, bs, 100, 2, gen), random_index(b, hq, n, bs, 50, 3, gen)]
    out = torch.zeros(b, n, hq, d, device=DEV)
    lse = torch.full((b, hq, n), float("-inf"), device=DEV)
    for (k, v), idx in zip(kvs, idxs):
        vs.vertical_slash_forward(q, k, v, idx, d**-0.5, out=out, lse=lse)
    g = hq // hkv
    scores, values = [], []
    for (k, v), idx in zip(kvs, idxs):
        s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(g, 2)) * d**-0.5
        scores.append(s.masked_fill(~index_to_dense_mask(idx, n), float("-inf")))
        values.append(v.double().repeat_interleave(g, 2))
    s = torch.cat(scores, -1)
    ref_out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), torch.cat(values, 1))
    record("merge two key sets, N=1100", "out", rel(out, ref_out), 5e-3)
    record("merge two key sets, N=1100", "lse", rel(lse, torch.logsumexp(s, -1)), 1e-3)


def attend(index, offm, colm, rows, keys):
    """Bool [B, Hq, len(rows), len(keys)]: the index's attend rule on the given positions."""
    bs = index.block_size
    off = rows[:, None] // bs - keys[None, :] // bs
    chosen = offm[:, :, off.clamp(min=0)]  # [B, H, R, K]
    return (keys[None, :] <= rows[:, None]) & (chosen | colm[:, :, keys][:, :, None, :])


def check_large(n):
    torch.manual_seed(n)
    b, hq, hkv, d, bs = 1, 16, 2, 128, 128
    g = hq // hkv
    q, do = (torch.randn(b, n, hq, d, device=DEV, dtype=DTYPE) for _ in range(2))
    k, v = (torch.randn(b, n, hkv, d, device=DEV, dtype=DTYPE) for _ in range(2))
    index = planted_index(b, hq, n, bs)
    scale = d**-0.5
    out, lse = vs.vertical_slash_forward(q, k, v, index, scale)
    dq, dk, dv = vs.vertical_slash_backward(do, q, k, v, out, lse, index, scale)
    offm, colm = index.offset_mask(n), index.column_mask(n)
    case = f"large N={n} planted, density {index.density(n).mean().item():.4f}"

    rows = torch.cat(
        [torch.randint(0, n, (128,), device=DEV), torch.arange(32, device=DEV), torch.arange(n - 32, n, device=DEV)]
    ).unique()
    mask = attend(index, offm, colm, rows, torch.arange(n, device=DEV))[0]  # [H, R, N]
    qf, kf, vf, dof = (x[0].float().transpose(0, 1) for x in (q, k, v, do))  # [H, N, D]
    kf, vf = kf.repeat_interleave(g, 0), vf.repeat_interleave(g, 0)
    s = (qf[:, rows] @ kf.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
    ref_lse = torch.logsumexp(s, -1)
    p = torch.exp(s - ref_lse[..., None])
    ref_out = p @ vf
    delta = (dof[:, rows] * ref_out).sum(-1)
    ds = p * (dof[:, rows] @ vf.transpose(1, 2) - delta[..., None])
    ref_dq = ds @ kf * scale
    del s, p, ds
    record(case, "out (rows)", rel(out[0, rows].transpose(0, 1), ref_out), 5e-3)
    record(case, "lse (rows)", rel(lse[0][:, rows], ref_lse), 1e-3)
    record(case, "dq (rows)", rel(dq[0, rows].transpose(0, 1), ref_dq), 5e-3)

    cols = index.vertical[0, :, :4].flatten()
    keys = torch.cat(
        [
            torch.arange(8, device=DEV),
            cols[cols >= 0],
            torch.randint(0, n, (64,), device=DEV),
            torch.tensor([n - 1], device=DEV),
        ]
    ).unique()
    lse_k, delta_k = lse[0], (do[0].float() * out[0].float()).sum(-1).transpose(0, 1)  # [H, N]
    ref_dk = torch.zeros(hkv, len(keys), d, device=DEV)
    ref_dv = torch.zeros_like(ref_dk)
    for h in range(hq):
        m = attend(index, offm[:, h : h + 1], colm[:, h : h + 1], torch.arange(n, device=DEV), keys)[0, 0]  # [N, K]
        s = (qf[h] @ kf[h, keys].T * scale).masked_fill(~m, float("-inf"))
        p = torch.exp(s - lse_k[h][:, None])
        ds = p * (dof[h] @ vf[h, keys].T - delta_k[h][:, None])
        ref_dv[h // g] += p.T @ dof[h]
        ref_dk[h // g] += ds.T @ qf[h] * scale
    record(case, "dk (keys)", rel(dk[0, keys].transpose(0, 1), ref_dk), 5e-3)
    record(case, "dv (keys)", rel(dv[0, keys].transpose(0, 1), ref_dv), 5e-3)
    return q, k, v, do, index


def check_dense_vs_sdpa(n=8192):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    torch.manual_seed(2)
    b, hq, hkv, d, bs = 1, 16, 2, 128, 128
    q, do = (torch.randn(b, n, hq, d, device=DEV, dtype=DTYPE) for _ in range(2))
    k, v = (torch.randn(b, n, hkv, d, device=DEV, dtype=DTYPE) for _ in range(2))
    index = VerticalSlashIndex.dense(b, hq, n, bs, device=DEV)
    out, lse = vs.vertical_slash_forward(q, k, v, index, d**-0.5)
    ours = [out, *vs.vertical_slash_backward(do, q, k, v, out, lse, index, d**-0.5)]

    def run(dtype, backend):
        leaves = [
            x.transpose(1, 2).to(dtype).repeat_interleave(hq // x.shape[2], 1).detach().requires_grad_()
            for x in (q, k, v)
        ]
        with sdpa_kernel(backend):
            o = sdpa(*leaves, is_causal=True)
        grads = torch.autograd.grad(o, leaves, do.transpose(1, 2).to(dtype))
        dk, dv = (x.unflatten(1, (hkv, hq // hkv)).sum(2) for x in grads[1:])
        return [t.transpose(1, 2) for t in (o.detach(), grads[0], dk, dv)]

    ref = run(torch.float32, SDPBackend.MATH)
    cudnn = run(DTYPE, SDPBackend.CUDNN_ATTENTION)
    for name, x, r, c in zip(["out", "dq", "dk", "dv"], ours, ref, cudnn):
        ec = rel(c, r)
        record(f"dense N={n} vs fp32 SDPA", name, rel(x, r), 2 * ec + 2e-3, f"cuDNN bf16: {ec:.2e}")


def check_dense_path(n=4096):
    from torch.profiler import ProfilerActivity, profile

    from ds_mtraining.sparse.attention import vertical_slash_attention

    torch.manual_seed(3)
    b, hq, hkv, d = 1, 16, 2, 128
    q, do = (torch.randn(b, n, hq, d, device=DEV, dtype=DTYPE) for _ in range(2))
    k, v = (torch.randn(b, n, hkv, d, device=DEV, dtype=DTYPE) for _ in range(2))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = vertical_slash_attention(*leaves, None)
        grads = torch.autograd.grad(out, leaves, do)
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages() if e.self_device_time_total > 0}
    kernel = next((x for x in sorted(names) if "cudnn" in x.lower() or "flash" in x.lower()), "no SDPA kernel seen")
    mask = torch.ones(n, n, dtype=torch.bool, device=DEV).tril()[None, None].expand(b, hq, n, n)
    ref = reference(q, k, v, mask, d**-0.5, do, torch.float64)
    base = reference(q, k, v, mask, d**-0.5, do, DTYPE)
    for name, x, r, bl in zip(["out", "dq", "dk", "dv"], [out, *grads], [ref[0], *ref[2:]], [base[0], *base[2:]]):
        eb = rel(bl, r)
        record(f"dense path N={n}", name, rel(x, r), min(2 * eb + 2e-3, 5e-3), f"{kernel[:48]}; torch bf16 {eb:.2e}")


def check_determinism(q, k, v, do, index):
    n = q.shape[1]
    scale = q.shape[-1] ** -0.5
    runs = []
    for _ in range(2):
        out, lse = vs.vertical_slash_forward(q, k, v, index, scale)
        runs.append([out, lse, *vs.vertical_slash_backward(do, q, k, v, out, lse, index, scale)])
    for name, a, c in zip(["out", "lse", "dq", "dk", "dv"], *runs):
        same = torch.equal(a, c)
        record(f"determinism N={n}", name, 0.0 if same else float("inf"), 0.0, "bitwise equal" if same else "differs")


def check_ring_shards(n=8192, world=2):
    """Check 6 (module docstring)."""
    torch.manual_seed(3)
    b, hq, hkv, d, bs = 1, 16, 2, 128, 64
    layout = make_layout("striped", world, n, block_size=bs)
    q, do = (torch.randn(b, n, hq, d, device=DEV, dtype=DTYPE) for _ in range(2))
    k, v = (torch.randn(b, n, hkv, d, device=DEV, dtype=DTYPE) for _ in range(2))
    index = planted_index(b, hq, n, bs, columns=240, local=512, device=DEV)
    scale = d**-0.5
    blocks = [layout.block_ids(r).to(DEV) for r in range(world)]
    # The maps span the padded sequence, so the index's kernel form is built (once, cached on it) for that length.
    maps = [vs.prepare_tile_map(x, index.num_blocks(layout.padded_len)) for x in blocks]
    qs, ks, vals, dos = ([layout.shard(x, r) for r in range(world)] for x in (q, k, v, do))
    for r in range(world):
        out = torch.zeros(b, layout.local_len, hq, d, device=DEV)
        lse = torch.full((b, hq, layout.local_len), float("-inf"), device=DEV)
        out_ref, lse_ref = out.clone(), lse.clone()
        order = [(r - u) % world for u in range(world)]  # the ring's: own shard first
        for kr in order:
            vs.vertical_slash_forward(
                qs[r], ks[kr], vals[kr], index, scale, out=out, lse=lse, q_blocks=maps[r], kv_blocks=maps[kr]
            )
            torch_path.vertical_slash_forward(
                qs[r],
                ks[kr],
                vals[kr],
                index,
                scale,
                out=out_ref,
                lse=lse_ref,
                q_blocks=blocks[r],
                kv_blocks=blocks[kr],
            )
            case = f"ring shards, striped W={world} N={n}: q shard {r}, kv shard {kr}"
            record(case, "out (merged so far)", rel(out, out_ref), 5e-3, "vs torch_path")
            record(case, "lse (merged so far)", rel(lse, lse_ref), 1e-3, "vs torch_path")
        final = out.to(DTYPE)
        for kr in order:
            args = (dos[r], qs[r], ks[kr], vals[kr], final, lse)
            got = vs.vertical_slash_backward(*args, index, scale, q_blocks=maps[r], kv_blocks=maps[kr])
            ref = torch_path.vertical_slash_backward(*args, index, scale, q_blocks=blocks[r], kv_blocks=blocks[kr])
            case = f"ring shards, striped W={world} N={n}: q shard {r}, kv shard {kr}"
            for name, x, y in zip(("dq", "dk", "dv"), got, ref):
                record(case, name, rel(x, y), 5e-3, "vs torch_path")


def check_compile(n=8192):
    """Check 7 (module docstring)."""
    from ds_mtraining.sparse.attention import vertical_slash_attention

    torch.manual_seed(4)
    b, hq, hkv, d, bs = 1, 16, 2, 128, 64
    index = planted_index(b, hq, n, bs, columns=240, local=512, device=DEV)

    def attention(q, k, v):  # check_index=False: the validation syncs with the host, as the model passes it
        return vertical_slash_attention(q, k, v, index, check_index=False)

    q, do = (torch.randn(b, n, hq, d, device=DEV, dtype=DTYPE) for _ in range(2))
    k, v = (torch.randn(b, n, hkv, d, device=DEV, dtype=DTYPE) for _ in range(2))
    explanation = torch._dynamo.explain(attention)(q, k, v)
    breaks = explanation.graph_break_count
    record(f"compile N={n}", "graph breaks", float(breaks), 0.0, f"{explanation.graph_count} graph(s)")
    compiled = torch.compile(attention, fullgraph=True)
    runs = []
    for fn in (attention, compiled):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        runs.append([out, *torch.autograd.grad(out, leaves, do)])
    for name, eager, graph in zip(("out", "dq", "dk", "dv"), *runs):
        same = torch.equal(eager, graph)
        record(f"compile N={n}", name, 0.0 if same else rel(graph, eager), 0.0, "compiled vs eager, bitwise")


def check_large_with_determinism():
    q, k, v, do, index = check_large(131072)
    check_determinism(q, k, v, do, index)


CHECKS = {
    "large-128k": check_large_with_determinism,
    "small": check_small,
    "merge": check_merge,
    "large-32k": lambda: check_large(32768),
    "dense-vs-sdpa": check_dense_vs_sdpa,
    "dense-path": check_dense_path,
    "ring-shards": check_ring_shards,
    "compile": check_compile,
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--checks", nargs="+", choices=CHECKS, default=list(CHECKS), help="the checks to run (all)")
    args = ap.parse_args()
    import triton

    head = [
        f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}",
        "command: python benchmarks/gpu_check.py " + " ".join(sys.argv[1:]),
        "",
        "| case | tensor | rel. error | limit | baseline | result |",
        "|---|---|---|---|---|---|",
    ]
    print("\n".join(head), flush=True)
    for name in args.checks:  # in CHECKS' order: the largest case first, it matters most
        try:
            CHECKS[name]()
        except Exception as err:  # noqa: BLE001 - a crash is a failure of this check, keep going
            record(name, "crashed", float("inf"), 0.0, repr(err)[:120])
    text = "\n".join(head + ROWS + ["", f"{len(ROWS) - len(FAILED)} passed, {len(FAILED)} failed"])
    print(f"\n{len(ROWS) - len(FAILED)} passed, {len(FAILED)} failed: {FAILED}")
    if args.out:
        Path(args.out).write_text(text + "\n")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
