"""``benchmarks.hopper_probe`` and its kernels (``benchmarks.hopper_kernels``) on the CPU, through the Triton
interpreter in fp32 / fp16.

Covered here: the probe runs end to end on a tiny case and its report has both tables; the step lists cover every
attended (query, key) entry exactly once and nothing else, for every (block size, BLOCK_M, BLOCK_N) the variants
use; every switch's code path (pointer and tensor-descriptor loads, 64- and 128-row programs at block 64 and 128,
32- / 64- / 128-key steps, ``ws``) computes out and lse within 1e-5 (fp32; fp16 2e-3) of a float64 reference built
from the index semantics on fresh random inputs, GQA, B=2; a dropped step is caught by those tolerances.

NOT covered here, and why (``tests/gpu/test_gpu_hopper_probe.py`` covers it on a GPU, bf16): the interpreter runs a
tensor descriptor's ``load`` as a numpy slice of the ``[B * N, H * D]`` view, so the indexing is checked but not the
sm_90 TMA lowering (descriptor alignment, the hardware's out-of-bounds fill); it ignores ``num_stages`` and
``warp_specialize`` (a ``ws`` / ``s4`` variant runs the very same Python as without), so the pipelined and
warp-specialised compiles, their shared-memory fit and any miscompile are unchecked; its bf16 ``tl.dot`` is wrong,
so bf16 runs only on the GPU; and no time measured here means anything.
"""

from __future__ import annotations

import pytest
import torch
from bench_reports import assert_finite, assert_header, numbers, table

from benchmarks import hopper_probe
from benchmarks.hopper_kernels import (
    Variant,
    attended_entries,
    build_steps,
    slash_forward,
    slash_index,
    slash_reference,
)
from ds_mtraining.sparse.index import VerticalSlashIndex


def _gapped_index(batch: int, heads: int, n: int, bs: int) -> VerticalSlashIndex:
    """Offsets with gaps and runs, a different set per head, so that 128-row programs at block 64 meet key blocks
    that only one of their two query tiles attends (partial blocks away from the diagonal)."""
    sets = [[0, 1, 3], [0, 2, 3, 5], [0, 1, 2, 4], [0, 3]]
    slash = torch.full((batch, heads, 4), -1, dtype=torch.long)
    for b in range(batch):
        for h in range(heads):
            offs = sets[(b + h) % len(sets)]
            slash[b, h, : len(offs)] = torch.tensor(offs)
    empty = torch.empty(batch, heads, 0, dtype=torch.long)
    return VerticalSlashIndex.build(empty, slash.clamp(max=n // bs - 1).where(slash >= 0, -1), bs)


def _inputs(n: int, dtype: torch.dtype, seed: int, batch: int = 2, hq: int = 4, hkv: int = 2, d: int = 64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n, hq, d, generator=gen).to(dtype)
    k, v = (torch.randn(batch, n, hkv, d, generator=gen).to(dtype) for _ in range(2))
    return q, k, v


def _err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref|; inf where ``x`` is not finite (a NaN must fail a ``<`` and pass a ``>``)."""
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


def test_probe_end_to_end(tmp_path):
    out = tmp_path / "hopper.md"
    args = ["--device", "cpu", "--dtype", "fp32", "--seqlen", "512", "--doc-len", "256", "--blocks", "128",
            "--check-seqlen", "256", "--local", "128", "--band", "64", "--heads", "2", "--kv-heads", "1",
            "--head-dim", "64", "--rep-ms", "1", "--variants", "ptr,m64,n64,w4,s1", "tma,m128,n64,w8,s3,ws",
            "--out", str(out)]  # fmt: skip
    assert hopper_probe.main(args) == 0
    text = out.read_text()
    assert_header(text, "hopper_probe")
    checks = table(text, "block | method")
    assert [r[1] for r in checks] == ["ours (today)", "triton ptr,m64,n64,w4,s1", "triton tma,m128,n64,w8,s3,ws"]
    assert all(max(numbers(r[2]) + numbers(r[3])) < 1e-5 for r in checks), checks
    rows = table(text, "block | workload")
    assert [r[1] for r in rows[::5]] == ["planted (1 x 512)", "all (2 x 256)"]
    for r in rows:
        if r[2] in ("cuDNN SDPA", "flash-attn-4 dense"):  # GPU only: said so, never a number
            assert r[3].startswith("not run") and "GPU only" in r[3], r
            continue
        assert_finite(r[3:6])
        assert r[6] == "nan"  # no cuDNN on CPU, so no per-entry speed
        if r[2].startswith("triton"):
            assert max(numbers(r[7])) < 1e-5 and numbers(r[8]), r
    assert len(rows) == 10


@pytest.mark.parametrize(
    ("bs", "block_m", "block_n"), [(64, 64, 64), (64, 128, 64), (64, 64, 32), (128, 128, 128), (128, 64, 64),
                                   (128, 128, 64)],
)  # fmt: skip
def test_steps_cover_each_attended_entry_once(bs, block_m, block_n):
    n = 768
    for index in (_gapped_index(2, 3, n, bs), slash_index(1, 2, n, bs, "planted", device="cpu", local=256, band=96)):
        steps = build_steps(index, n, block_m, block_n)
        bitmap = index.offset_mask(n)
        pos = torch.arange(n)
        off = (pos[:, None] // bs - pos[None, :] // bs).clamp_min(0)
        want = bitmap[..., off] & (pos[None, :] <= pos[:, None])  # [B, Hq, N, N]
        got = torch.zeros(want.shape, dtype=torch.int32).flatten(0, 1)
        sub = min(bs, block_m)
        for g in range(got.shape[0]):
            for r in range(n // block_m):
                rows = slice(r * block_m, (r + 1) * block_m)
                for s in range(steps.fcount[g, r]):
                    kb = steps.full[g, r, s].item()
                    got[g, rows, kb * block_n : (kb + 1) * block_n] += 1
                for s in range(steps.pcount[g, r]):
                    kb, bits = steps.part[g, r, s].item(), steps.pbits[g, r, s].item()
                    keys = kb * block_n + torch.arange(block_n)
                    rr = r * block_m + torch.arange(block_m)
                    on = ((bits >> (torch.arange(block_m) // sub)) & 1).bool()[:, None] & (keys[None, :] <= rr[:, None])
                    got[g, rows, kb * block_n : (kb + 1) * block_n] += on.int()
                # The lists are descending (the diagonal first) and hold no key block twice.
                assert steps.full[g, r, : steps.fcount[g, r]].diff().lt(0).all()
                assert steps.part[g, r, : steps.pcount[g, r]].diff().lt(0).all()
        assert torch.equal(got.view(want.shape), want.int())
        assert attended_entries(index, n) == int(want.sum())


SPECS = [
    (64, "ptr,m64,n64,w4,s3"),
    (64, "tma,m64,n64,w4,s3"),
    (64, "tma,m128,n64,w8,s3,ws"),
    (64, "ptr,m64,n32,w4,s1"),
    (128, "ptr,m128,n128,w8,s3"),
    (128, "tma,m128,n128,w8,s2"),
    (128, "tma,m128,n64,w8,s4,ws"),
    (128, "tma,m64,n64,w4,s3"),
]


@pytest.mark.parametrize(("bs", "spec"), SPECS)
def test_variant_against_float64(bs, spec):
    n = 384
    var = Variant.parse(spec)
    assert var.spec == spec
    index = _gapped_index(2, 4, n, bs)
    q, k, v = _inputs(n, torch.float32, seed=SPECS.index((bs, spec)))
    out, lse = slash_forward(q, k, v, build_steps(index, n, var.block_m, var.block_n), var)
    ref_out, ref_lse = slash_reference(q, k, v, index)
    assert out.dtype == torch.float32 and lse.shape == (2, 4, n)
    assert _err(out, ref_out) < 1e-5 and _err(lse, ref_lse) < 1e-5


def test_variant_fp16():
    n, bs = 256, 64
    var = Variant.parse("tma,m128,n64,w8,s3")
    index = slash_index(2, 4, n, bs, "planted", device="cpu", local=64, band=64)
    q, k, v = _inputs(n, torch.float16, seed=7)
    out, lse = slash_forward(q, k, v, build_steps(index, n, var.block_m, var.block_n), var)
    ref_out, ref_lse = slash_reference(q, k, v, index)
    assert out.dtype == torch.float16
    assert _err(out, ref_out) < 2e-3 and _err(lse, ref_lse) < 2e-3


@pytest.mark.parametrize("which", ["full", "part"])
def test_tolerance_catches_a_dropped_step(which):
    """One program's last step left out of its list: out moves far beyond the 1e-5 of the tests above."""
    n, bs = 256, 64
    var = Variant.parse("tma,m128,n64,w8,s3")
    index = _gapped_index(2, 4, n, bs)
    steps = build_steps(index, n, var.block_m, var.block_n)
    count = steps.fcount if which == "full" else steps.pcount
    g, r = (count > 1).nonzero()[0].tolist()
    count[g, r] -= 1
    q, k, v = _inputs(n, torch.float32, seed=3)
    out, lse = slash_forward(q, k, v, steps, var)
    ref_out, ref_lse = slash_reference(q, k, v, index)
    assert _err(out, ref_out) > 1e-2 or _err(lse, ref_lse) > 1e-3


def test_dense_length_matches_the_entries():
    assert hopper_probe.dense_length(16 * 1024 * 1025 // 2, 1, 16) == 1024
    assert hopper_probe.dense_length(16 * 30000 * 30001 // 2, 1, 16) in (29952, 30080)


def test_variant_specs_are_checked():
    for bad in ("fast,m64", "tma,m96", "ptr,x3", "tma,w3"):
        with pytest.raises(ValueError):
            Variant.parse(bad)
    assert [v.spec for v in hopper_probe.default_variants(64, 128)][:2] == ["ptr,m64,n64,w4,s3", "tma,m64,n64,w4,s3"]
