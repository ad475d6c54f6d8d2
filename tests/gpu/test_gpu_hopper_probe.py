"""``benchmarks.hopper_kernels`` on a GPU, bf16, at the probe's shape (Hq=16, Hkv=2, D=128): every variant the probe
times by default (``hopper_probe.default_variants``, block 64 and 128; TMA descriptors, 2-4 stages, 128-row programs
with 8 warps, warp specialisation) compiles for this GPU and computes the slash-only forward.

- N=2048, B=2, the planted slash pattern scaled down (local band 512, far bands 256 tokens): out and lse against the
  float64 reference of the index semantics (``slash_reference``) from the same bf16 inputs. Errors are relative,
  ``||x - ref|| / ||ref||``; limits 5e-3 for out (bf16 operands, P rounded to bf16 before PV, as in
  ``test_gpu_attention.py``; a dropped tile gives errors of order 0.1 on its rows) and 1e-4 for lse (fp32 softmax
  statistics from bf16 scores).
- N=32K, B=1, the planted slash pattern at full size: every variant against today's kernel
  (``vertical_slash_forward``) on the same inputs, 5e-3 / 1e-4: the same work at a size where each program walks
  the probe's number of steps.

What the CPU test (``tests/test_bench_hopper_probe.py``) cannot check and this does: the sm_90 TMA lowering, the
pipelined (``num_stages``) and warp-specialised compiles and their shared-memory fit, bf16 ``tl.dot``. A variant that
Triton rejects on this GPU fails here with Triton's error (the probe reports it as a FAILED row instead).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.hopper_kernels import Variant, build_steps, slash_forward, slash_index, slash_reference
from benchmarks.hopper_probe import default_variants
from ds_mtraining.sparse.triton import vertical_slash_forward

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = torch.bfloat16
cuda = pytest.mark.cuda
HQ, HKV, D = 16, 2, 128
CASES = [(bs, v.spec) for bs in (64, 128) for v in default_variants(bs, D)]


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64; inf when ``x`` has a non-finite value."""
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _inputs(batch: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(batch, n, HQ, D, device=DEVICE, dtype=BF16, generator=gen)
    k, v = (torch.randn(batch, n, HKV, D, device=DEVICE, dtype=BF16, generator=gen) for _ in range(2))
    return q, k, v


def _run(spec: str, index, q, k, v):
    var = Variant.parse(spec)
    return slash_forward(q, k, v, build_steps(index, q.shape[1], var.block_m, var.block_n), var)


@cuda
@pytest.mark.parametrize(("bs", "spec"), CASES)
def test_variant_against_float64(bs, spec):
    n = 2048
    index = slash_index(2, HQ, n, bs, "planted", seed=1, device=DEVICE, local=512, band=256)
    q, k, v = _inputs(2, n, seed=1)
    out, lse = _run(spec, index, q, k, v)
    ref_out, ref_lse = slash_reference(q, k, v, index)
    assert out.dtype == BF16 and lse.dtype == torch.float32
    assert rel(out, ref_out) < 5e-3, rel(out, ref_out)
    assert rel(lse, ref_lse) < 1e-4, rel(lse, ref_lse)


@cuda
@pytest.mark.parametrize(("bs", "spec"), CASES)
def test_variant_against_todays_kernel_at_32k(bs, spec):
    n = 32768
    index = slash_index(1, HQ, n, bs, "planted", device=DEVICE)
    q, k, v = _inputs(1, n, seed=2)
    out, lse = _run(spec, index, q, k, v)
    ours_out, ours_lse = vertical_slash_forward(q, k, v, index)
    assert rel(out, ours_out) < 5e-3, rel(out, ours_out)
    assert rel(lse, ours_lse) < 1e-4, rel(lse, ours_lse)
