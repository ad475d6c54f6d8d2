"""Triton vertical-slash kernels against the float64 reference (CPU: through the Triton interpreter).

fp32: the kernels' error must be near fp32 rounding (a dropped tile or a double-counted column moves outputs
by O(0.1)). fp16: within a small multiple of the error of the same reference computed in fp16 by PyTorch.
bf16 is not tested here: the interpreter's bf16 ``tl.dot`` is broken (the GPU check covers bf16).
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

from ds_mtraining.sparse.index import VerticalSlashIndex, index_to_dense_mask
from ds_mtraining.sparse.reference import reference_attention
from ds_mtraining.sparse.triton import launch_config, prepare_index, vertical_slash_backward, vertical_slash_forward

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_index(b, h, n, bs, num_cols, num_offsets, gen):
    """A canonical index with ``num_cols`` random columns (some -1) and ``num_offsets`` random offsets."""
    nb = -(-n // bs)
    vertical = torch.randint(0, n, (b, h, num_cols), generator=gen)
    if num_cols:
        vertical[..., -max(1, num_cols // 5) :] = -1  # padding, then duplicates below
        vertical[..., 0] = vertical[..., 1]
    slash = torch.randint(0, nb, (b, h, num_offsets), generator=gen)
    return VerticalSlashIndex.build(vertical.to(DEVICE), slash.to(DEVICE), bs)  # where the kernels read it


def make_inputs(b, n, hq, hkv, d, dtype, gen):
    q, k, v = (torch.randn(b, n, h, d, generator=gen).to(DEVICE, dtype) for h in (hq, hkv, hkv))
    return q, k, v


def reference(q, k, v, index, scale, do, dtype):
    """out, lse, dq, dk, dv of the reference attention computed in ``dtype``."""
    n = q.shape[1]
    mask = index_to_dense_mask(VerticalSlashIndex(index.vertical.cpu(), index.slash.cpu(), index.block_size), n)
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out, lse = reference_attention(*leaves, mask, scale)
    out.backward(do.to(dtype))
    return [out.detach(), lse.detach()] + [x.grad for x in leaves]


def max_err(x, ref):
    return (x.double() - ref.double().to(x.device)).abs().max().item()


CASES = [
    # id, N, bs, Hq, Hkv, D, dtype, index kind
    pytest.param(200, 64, 4, 2, 64, torch.float32, "random", id="fp32-N200-bs64-gqa2-d64"),
    pytest.param(200, 64, 2, 1, 64, torch.float32, "no-columns", id="fp32-N200-bs64-mqa-d64-no-columns"),
    pytest.param(200, 64, 4, 2, 64, torch.float32, "dense", id="fp32-N200-bs64-dense"),
    pytest.param(256, 128, 4, 2, 128, torch.float32, "random", id="fp32-N256-bs128-d128"),
    pytest.param(200, 64, 4, 2, 64, torch.float16, "random", id="fp16-N200-bs64-gqa2-d64"),
    pytest.param(300, 128, 2, 1, 128, torch.float16, "random", id="fp16-N300-bs128-mqa-d128"),
    pytest.param(200, 64, 6, 2, 64, torch.float32, "random", id="fp32-N200-bs64-group3-d64"),  # SmolLM2's groups
    pytest.param(200, 64, 2, 2, 64, torch.float32, "random", id="fp32-N200-bs64-mha-d64"),  # groups of one head
]


def build_index(kind, b, hq, n, bs, gen):
    if kind == "dense":
        return VerticalSlashIndex.dense(b, hq, n, bs, device=DEVICE)
    if kind == "no-columns":
        return VerticalSlashIndex.build(
            torch.empty(b, hq, 0, dtype=torch.long, device=DEVICE),
            torch.tensor([[[2]]], device=DEVICE).expand(b, hq, 1),
            bs,
        )
    return random_index(b, hq, n, bs, num_cols=80, num_offsets=2, gen=gen)


@pytest.mark.parametrize("n, bs, hq, hkv, d, dtype, kind", CASES)
def test_forward_backward_match_reference(n, bs, hq, hkv, d, dtype, kind):
    gen = torch.Generator().manual_seed(n * 7 + hq + d)
    b = 2
    q, k, v = make_inputs(b, n, hq, hkv, d, dtype, gen)
    index = build_index(kind, b, hq, n, bs, gen)
    scale = d**-0.5
    do = torch.randn(q.shape, generator=gen).to(DEVICE, dtype)

    out, lse = vertical_slash_forward(q, k, v, index, scale)
    dq, dk, dv = vertical_slash_backward(do, q, k, v, out, lse, index, scale)
    got = [out, lse, dq, dk, dv]
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (b, hq, n)
    assert dq.dtype == dk.dtype == dv.dtype == dtype and dk.shape == k.shape

    ref = reference(
        q.cpu(), k.cpu(), v.cpu(), VerticalSlashIndex(index.vertical, index.slash, bs), scale, do.cpu(), torch.float64
    )
    names = ["out", "lse", "dq", "dk", "dv"]
    if dtype == torch.float32:
        for name, x, r in zip(names, got, ref):
            assert torch.isfinite(x).all(), name
            # The interpreter computes fp32 dots exactly in fp32; on a GPU Triton runs them as tf32.
            tol = (2e-5 if DEVICE == "cpu" else 1e-2) * (1.0 + r.abs().max().item())
            assert max_err(x.cpu(), r) <= tol, f"{name}: max error {max_err(x.cpu(), r):.3g} > {tol:.3g}"
    else:
        base = reference(q.cpu(), k.cpu(), v.cpu(), index, scale, do.cpu(), dtype)
        for name, x, r, bl in zip(names, got, ref, base):
            assert torch.isfinite(x).all(), name
            limit = 3.0 * max_err(bl, r) + 1e-4
            assert max_err(x.cpu(), r) <= limit, f"{name}: max error {max_err(x.cpu(), r):.3g} > {limit:.3g}"


@pytest.mark.parametrize("n, bs, hq, hkv, d, dtype, kind", [CASES[0], CASES[4]])
def test_column_pass_split_over_query_tiles_matches_reference(monkeypatch, n, bs, hq, hkv, d, dtype, kind):
    """The tests above run one column-pass program per chunk (few query tiles); long sequences split each chunk's
    tiles over several programs, whose planes the dk/dv pass sums: forced here."""
    monkeypatch.setattr(launch_config, "COL_SPLIT_TILES", 1)
    assert launch_config.column_splits(-(-n // bs), hq, 1) == launch_config.COL_SPLIT > 1
    test_forward_backward_match_reference(n, bs, hq, hkv, d, dtype, kind)


def test_the_column_pass_splits_its_tiles_for_long_chunks_and_to_fill_the_gpu():
    """``column_splits`` on the 3B shape (16 heads, D 128, planted 5 %, chunks of 64 columns): one device at 256K keeps
    the tuned 4 (31 chunks a head); a W = 32 ring step at 256K, whose 128 query tiles meet one chunk a head, splits
    them 16 ways (8 tiles a program; one program a head left 16 programs walking 128 tiles each); the planes never
    exceed the buffer's budget, and a launch that already fills the GPU with short chunks is not split."""
    plane = 2 * 16 * 128 * 4  # bytes of one column's dk and dv in 16 heads
    assert launch_config.column_splits(4096, 16 * 31, 1984 * plane) == 4
    assert launch_config.column_splits(128, 16, 64 * plane) == 16
    assert launch_config.column_splits(128, 16, launch_config.COL_BUFFER_BYTES // 3) == 3
    assert launch_config.column_splits(64, 16 * 485, 31000 * plane) == 1
    assert launch_config.column_splits(16, 16, 64 * plane) == 2  # at least COL_SPLIT_MIN_TILES tiles a program


def test_merge_into_running_output_equals_joint_softmax():
    """Two forward calls over disjoint key sets merged in place equal one softmax over their union."""
    gen = torch.Generator().manual_seed(3)
    b, n, hq, hkv, d, bs = 2, 200, 4, 2, 64, 64
    q, k1, v1 = make_inputs(b, n, hq, hkv, d, torch.float32, gen)
    _, k2, v2 = make_inputs(b, n, hq, hkv, d, torch.float32, gen)
    idx1 = random_index(b, hq, n, bs, 40, 1, gen)
    idx2 = random_index(b, hq, n, bs, 40, 2, gen)
    scale = d**-0.5

    out = torch.zeros(b, n, hq, d, device=DEVICE)
    lse = torch.full((b, hq, n), float("-inf"), device=DEVICE)
    for k, v, idx in ((k1, v1, idx1), (k2, v2, idx2)):
        ret = vertical_slash_forward(q, k, v, idx, scale, out=out, lse=lse)
        assert ret[0] is out and ret[1] is lse

    group = hq // hkv
    scores, values = [], []
    for k, v, idx in ((k1, v1, idx1), (k2, v2, idx2)):
        kk = k.cpu().double().repeat_interleave(group, 2)
        s = torch.einsum("bqhd,bkhd->bhqk", q.cpu().double(), kk) * scale
        scores.append(s.masked_fill(~index_to_dense_mask(idx, n).cpu(), float("-inf")))
        values.append(v.cpu().double().repeat_interleave(group, 2))
    s = torch.cat(scores, -1)
    ref_lse = torch.logsumexp(s, -1)
    ref_out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), torch.cat(values, 1))
    tol = 1e-4 if DEVICE == "cpu" else 1e-2  # a GPU runs fp32 dots as tf32
    assert max_err(lse.cpu(), ref_lse) < tol
    assert max_err(out.cpu(), ref_out) < tol


def test_backward_is_bitwise_deterministic_and_the_kernel_form_is_cached_on_the_index():
    """A ``VerticalSlashIndex`` is converted once (``kernel_index``, cached per tile count) and gives the results
    of a separately prepared ``KernelIndex`` bit for bit; two backward runs are bitwise equal."""
    gen = torch.Generator().manual_seed(5)
    b, n, hq, hkv, d, bs = 1, 200, 4, 1, 64, 64
    q, k, v = make_inputs(b, n, hq, hkv, d, torch.float16, gen)
    index = random_index(b, hq, n, bs, 60, 2, gen)
    kidx = prepare_index(index, n)
    cached = index.kernel_index(n)
    assert index.kernel_index(n) is cached and index.kernel_index(n - 1) is cached  # same tile count
    assert cached.num_blocks == kidx.num_blocks and all(map(torch.equal, cached.tensors, kidx.tensors))
    out, lse = vertical_slash_forward(q, k, v, kidx, 0.125)
    out2, lse2 = vertical_slash_forward(q, k, v, index, 0.125)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    do = torch.randn(q.shape, generator=gen).to(DEVICE, q.dtype)
    first = vertical_slash_backward(do, q, k, v, out, lse, kidx, 0.125)
    second = vertical_slash_backward(do, q, k, v, out, lse, index, 0.125)
    for a, c in zip(first, second):
        assert torch.equal(a, c)


def test_rejects_unsupported_head_dim():
    q = torch.zeros(1, 64, 1, 32)
    index = VerticalSlashIndex.dense(1, 1, 64, 64)
    with pytest.raises(ValueError, match="head dim must be 64 or 128"):
        vertical_slash_forward(q, q, q, index, 1.0)


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan"), float("inf")])
@pytest.mark.parametrize("launcher", ["vertical_slash_forward", "vertical_slash_backward"])
def test_rejects_a_scale_that_is_not_positive(launcher, scale):
    """The kernels take row maxima of the unscaled scores (a positive scale keeps their order): both launchers
    refuse any other scale with one error, before launching anything."""
    q = torch.zeros(1, 64, 1, 64)
    lse = torch.zeros(1, 1, 64)
    index = VerticalSlashIndex.dense(1, 1, 64, 64)
    message = f"^{launcher}: softmax_scale must be a positive finite number; got {scale!r}"
    with pytest.raises(ValueError, match=message):
        if launcher == "vertical_slash_forward":
            vertical_slash_forward(q, q, q, index, scale)
        else:
            vertical_slash_backward(q, q, q, q, q, lse, index, scale)


def test_dense_layout_keeps_exactly_the_tensors_whose_strides_empty_like_keeps():
    """``dense_layout`` reads the strides instead of allocating: on every permutation of a 4-d tensor (with and without
    a dim of size 1) and on slices, steps, broadcasts and overlaps, it keeps ``x`` exactly where
    ``torch.empty_like(x)`` has ``x``'s strides (so a gradient allocated like it can be written with them), else it
    copies to contiguous."""
    from ds_mtraining.sparse.triton.backward import dense_layout

    base = torch.randn(2, 6, 3, 4)
    cases = [
        base[:, :, :2],  # a slice of a fused projection
        base[..., ::2],
        base[:, :1].expand(2, 6, 3, 4),  # a broadcast
        torch.randn(12, 8)[:, :4].reshape(12, 2, 2),
        torch.randn(8, 8)[::2, ::2],
        torch.randn(5, 1, 3).as_strided((5, 1, 3), (3, 7, 1)),  # a size-1 dim's stride is never used
        torch.randn(4, 3).as_strided((4, 3), (1, 1)),  # overlapping
        torch.randn(2, 0, 3),
    ]
    for shape in ((2, 6, 3, 4), (2, 1, 3, 4)):
        cases += [torch.randn(shape).permute(*p) for p in itertools.permutations(range(4))]
    kept = 0
    for x in cases:
        dense = torch.empty_like(x).stride() == x.stride()
        y = dense_layout(x)
        assert (y is x) == dense, (tuple(x.shape), x.stride())
        assert torch.equal(y, x) and (y is x or y.is_contiguous())
        kept += dense
    assert 0 < kept < len(cases)


def test_tile_programs_are_laid_on_grid_axis_0(monkeypatch):
    """CUDA limits grid axes 1 and 2 to 65535 programs, and 4M tokens in tiles of 64 are 65536 (the device refused the
    dk/dv launch of a whole gathered K/V at 4M as an invalid argument): the forward, dq and dk/dv passes put all their
    tile programs on axis 0, and their results stay the float64 reference's."""
    from ds_mtraining.sparse.triton import backward, forward

    grids = {}
    for module, name in ((forward, "_fwd_kernel"), (backward, "_bwd_dq_kernel"), (backward, "_bwd_dkdv_kernel")):
        kernel = getattr(module, name)

        class Recorder:
            def __getitem__(self, grid, kernel=kernel, name=name):
                grids[name] = grid
                return kernel[grid]

        monkeypatch.setattr(module, name, Recorder())
    gen = torch.Generator().manual_seed(9)
    b, n, hq, hkv, d, bs = 2, 192, 4, 2, 64, 64
    q, k, v = make_inputs(b, n, hq, hkv, d, torch.float32, gen)
    do = torch.randn(b, n, hq, d, generator=gen).to(DEVICE)
    index = random_index(b, hq, n, bs, 20, 2, gen)
    out, lse = vertical_slash_forward(q, k, v, index, d**-0.5)
    got = [out, *vertical_slash_backward(do, q, k, v, out, lse, index, d**-0.5)]
    tiles = n // bs
    assert grids == {"_fwd_kernel": (b * hq * tiles,), "_bwd_dq_kernel": (b * hq * tiles,),
                     "_bwd_dkdv_kernel": (b * hkv * tiles,)}  # fmt: skip
    want = reference(q.cpu(), k.cpu(), v.cpu(), index, d**-0.5, do.cpu(), torch.float64)
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, want[:1] + want[2:], strict=True):
        # The interpreter computes fp32 dots exactly in fp32; on a GPU Triton runs them as tf32.
        tol = (2e-4 if DEVICE == "cpu" else 1e-2) * (1.0 + y.abs().max().item())
        assert max_err(x.cpu(), y) < tol, f"{name}: max diff {max_err(x.cpu(), y):.3e}"


@pytest.mark.parametrize("layout", ["sliced", "transposed"])
def test_any_input_strides_give_the_contiguous_results(layout):
    """q, k, v, do as views (slices of a fused qkv, or transposed from ``[B, H, N, D]``): out, lse, dq, dk, dv are
    the contiguous inputs' results bit for bit, and the gradients have their input's shape."""
    gen = torch.Generator().manual_seed(5)
    b, n, hq, hkv, d, bs = 1, 200, 4, 2, 64, 64
    q, k, v = make_inputs(b, n, hq, hkv, d, torch.float32, gen)
    do = torch.randn(b, n, hq, d, generator=gen).to(DEVICE)
    index = random_index(b, hq, n, bs, 40, 3, gen)
    scale = d**-0.5
    out, lse = vertical_slash_forward(q, k, v, index, scale)
    expected = [out, lse, *vertical_slash_backward(do, q, k, v, out, lse, index, scale)]
    if layout == "sliced":  # one [B, N, Hq + 2 Hkv, D] buffer, as a fused projection gives it
        fused = torch.cat([q, k, v], dim=2)
        views = (fused[:, :, :hq], fused[:, :, hq : hq + hkv], fused[:, :, hq + hkv :])
        dov = torch.cat([do, do], dim=2)[:, :, :hq]
    else:  # [B, H, N, D] storage seen as [B, N, H, D], as transformers hands them over
        views = tuple(x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
        dov = do.transpose(1, 2).contiguous().transpose(1, 2)
    assert not any(x.is_contiguous() for x in (*views, dov))
    out2, lse2 = vertical_slash_forward(*views, index, scale)
    got = [out2, lse2, *vertical_slash_backward(dov, *views, out2, lse2, index, scale)]
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), got, expected, strict=True):
        assert x.shape == y.shape, name
        assert torch.equal(x, y), f"{name}: max diff {max_err(x, y):.3e}"
