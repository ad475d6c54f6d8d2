"""Packed documents on the Triton kernels (issue 26): forward, dq, dk/dv and the column pass against the float64
reference of ``AttentionPattern(n, index, documents).dense_mask()``, on one device and on ring shards (tile maps).
CPU: the Triton interpreter (``conftest.py``); fp32 there computes the dots exactly in fp32 (on a GPU, tf32), fp16 is
held to a small multiple of the same reference computed in fp16 by PyTorch (the interpreter's bf16 ``tl.dot`` is
broken)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_documents import _documents
from test_triton_kernels import DEVICE, make_inputs, max_err, random_index

from ds_mtraining.parallel.layout import make_layout
from ds_mtraining.parallel.ring import shard_index
from ds_mtraining.parallel.work import offset_shards, offsets_reaching
from ds_mtraining.sparse import (
    AttentionPattern,
    Documents,
    VerticalSlashIndex,
    attention,
    reference_attention,
    torch_path,
    vertical_slash_attention,
)
from ds_mtraining.sparse import triton as triton_backend
from ds_mtraining.sparse.triton import prepare_tile_map, vertical_slash_backward, vertical_slash_forward
from ds_mtraining.sparse.triton.document_tiles import last_query_tiles

D = 64  # the kernels' smallest head dim and block size
NAMES = ("out", "lse", "dq", "dk", "dv")
# Rows that meet no key of a ring shard get lse = log(0) = -inf by design; the interpreter (numpy) warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")


def _reference(q, k, v, do, index, docs, scale, dtype):
    """out, lse, dq, dk, dv of the document-masked reference, computed in ``dtype``."""
    mask = AttentionPattern(q.shape[1], _moved(index, "cpu"), docs).dense_mask()  # docs live on the CPU
    leaves = [x.detach().cpu().to(dtype).requires_grad_() for x in (q, k, v)]
    out, lse = reference_attention(*leaves, mask, scale)
    out.backward(do.cpu().to(dtype))
    return [out.detach(), lse.detach()] + [x.grad for x in leaves]


def _limits(q, k, v, do, index, docs, scale, dtype, ref):
    """Per-output tolerance: near fp32 rounding for fp32 (tf32 on a GPU), else 3x the same-dtype baseline's error."""
    if dtype == torch.float32:
        return [(2e-5 if DEVICE == "cpu" else 1e-2) * (1.0 + r.abs().max().item()) for r in ref]
    base = _reference(q, k, v, do, index, docs, scale, dtype)
    return [3.0 * max_err(b, r) + 1e-4 for b, r in zip(base, ref)]


def _moved(index: VerticalSlashIndex, device: str = DEVICE) -> VerticalSlashIndex:
    return VerticalSlashIndex(index.vertical.to(device), index.slash.to(device), index.block_size)


def _run(q, k, v, do, index, scale, doc_start):
    """out, lse, dq, dk, dv of the kernels (``index`` and ``doc_start`` moved to the inputs' device)."""
    index = _moved(index)
    doc_start = None if doc_start is None else doc_start.to(DEVICE)
    out, lse = vertical_slash_forward(q, k, v, index, scale, doc_start=doc_start)
    return [out, lse, *vertical_slash_backward(do, q, k, v, out, lse, index, scale, doc_start=doc_start)]


# Document lengths per row (every row sums to N): 1, bs - 1, bs, bs + 1 put a boundary at every phase of the tiles;
# partial last tiles throughout. bs = 128 splits a tile over two fp32 programs; at N = 300 the last one is past N.
CASES = [
    pytest.param([[1] * 130], 64, 4, 2, "random", id="len1-gqa2"),
    pytest.param([[63] * 3 + [11]], 64, 4, 2, "random", id="len-bs-1-gqa2"),
    pytest.param([[64] * 3 + [8]], 64, 4, 2, "random", id="len-bs-gqa2"),
    pytest.param([[65] * 3 + [5]], 64, 2, 1, "random", id="len-bs+1-mqa"),
    pytest.param([[1, 63, 64, 65, 3, 4]], 64, 6, 2, "random", id="mixed-group3"),
    pytest.param([[5, 100, 95], [64, 1, 135]], 64, 4, 2, "random", id="batch2-own-boundaries"),
    pytest.param([[5, 100, 95], [64, 1, 135]], 64, 4, 2, "dense", id="batch2-dense-index"),
    pytest.param([[1, 127, 128, 44]], 128, 4, 2, "random", id="mixed-bs128"),
]


@pytest.mark.parametrize("lengths, bs, hq, hkv, kind", CASES)
def test_kernels_inside_documents_match_reference(lengths, bs, hq, hkv, kind):
    docs = _documents(lengths)
    b, n = docs.starts.shape
    gen = torch.Generator().manual_seed(n + hq + bs)
    q, k, v = make_inputs(b, n, hq, hkv, D, torch.float32, gen)
    do = torch.randn(q.shape, generator=gen).to(DEVICE)
    if kind == "dense":
        index = VerticalSlashIndex.dense(b, hq, n, bs)
    else:
        index = random_index(b, hq, n, bs, num_cols=40, num_offsets=3, gen=gen)
    scale = D**-0.5
    got = _run(q, k, v, do, index, scale, docs.starts)
    ref = _reference(q, k, v, do, index, docs, scale, torch.float64)
    for name, x, r, lim in zip(NAMES, got, ref, _limits(q, k, v, do, index, docs, scale, torch.float32, ref)):
        assert torch.isfinite(x).all(), name
        assert max_err(x.cpu(), r) <= lim, f"{name}: max error {max_err(x.cpu(), r):.3g} > {lim:.3g}"


def test_fp16_inside_documents_is_a_small_multiple_of_the_baseline():
    docs = _documents([[1, 63, 64, 65, 7], [130, 1, 69]])
    b, n = docs.starts.shape
    gen = torch.Generator().manual_seed(11)
    q, k, v = make_inputs(b, n, 4, 2, D, torch.float16, gen)
    do = torch.randn(q.shape, generator=gen).to(DEVICE, torch.float16)
    index = random_index(b, 4, n, 64, num_cols=40, num_offsets=3, gen=gen)
    got = _run(q, k, v, do, index, 0.125, docs.starts)
    ref = _reference(q, k, v, do, index, docs, 0.125, torch.float64)
    for name, x, r, lim in zip(NAMES, got, ref, _limits(q, k, v, do, index, docs, 0.125, torch.float16, ref)):
        assert max_err(x.cpu(), r) <= lim, f"{name}: max error {max_err(x.cpu(), r):.3g} > {lim:.3g}"


def test_one_document_per_row_equals_no_documents_bit_for_bit():
    gen = torch.Generator().manual_seed(4)
    b, n, hq, hkv = 2, 200, 4, 2
    q, k, v = make_inputs(b, n, hq, hkv, D, torch.float32, gen)
    do = torch.randn(q.shape, generator=gen).to(DEVICE)
    index = random_index(b, hq, n, 64, num_cols=40, num_offsets=3, gen=gen)
    plain = _run(q, k, v, do, index, 0.125, None)
    one = _run(q, k, v, do, index, 0.125, torch.zeros(b, n, dtype=torch.long))
    for name, x, y in zip(NAMES, one, plain):
        assert torch.equal(x, y), f"{name}: max diff {max_err(x, y):.3g}"


def test_attention_with_documents_runs_the_triton_ops(monkeypatch):
    """``vertical_slash_attention`` with a pattern of an index and documents runs the Triton ops (forced for CPU
    tensors, as on CUDA): no refusal, the reference's out, lse and gradients through the autograd Function."""
    monkeypatch.setattr(attention, "kernel_backend", lambda q: triton_backend)
    docs = _documents([[5, 100, 95], [64, 1, 135]])
    gen = torch.Generator().manual_seed(6)
    q, k, v = make_inputs(2, 200, 4, 2, D, torch.float32, gen)
    do = torch.randn(q.shape, generator=gen).to(DEVICE)
    index = random_index(2, 4, 200, 64, num_cols=40, num_offsets=3, gen=gen)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    on_device = Documents(docs.starts.to(DEVICE))
    out, lse = vertical_slash_attention(*leaves, AttentionPattern(200, _moved(index), on_device), return_lse=True)
    got = [out, lse, *torch.autograd.grad(out, leaves, do)]
    ref = _reference(q, k, v, do, index, docs, D**-0.5, torch.float64)
    for name, x, r, lim in zip(NAMES, got, ref, _limits(q, k, v, do, index, docs, D**-0.5, torch.float32, ref)):
        assert max_err(x.detach(), r) <= lim, name


def test_triton_ops_with_documents_pass_opcheck():
    """Schema and fake kernels of the Triton ops with ``doc_start`` (what ``torch.compile`` traces)."""
    docs = _documents([[3, 100, 25], [65, 63]])
    gen = torch.Generator().manual_seed(7)
    q, k, v = make_inputs(2, 128, 4, 2, D, torch.float32, gen)
    do = torch.randn(q.shape, generator=gen).to(DEVICE)
    index = _moved(random_index(2, 4, 128, 64, num_cols=12, num_offsets=2, gen=gen))
    args = (*triton_backend.index_tensors(index, 128), 64, 0.125, docs.starts.to(DEVICE))
    out, lse = triton_backend.forward_op(q, k, v, *args)
    torch.library.opcheck(triton_backend.forward_op, (q, k, v, *args))
    torch.library.opcheck(triton_backend.backward_op, (do, q, k, v, out, lse, *args))


@pytest.mark.parametrize(("kind", "world"), [("striped", 2), ("zigzag", 2), ("striped", 3)])
def test_ring_shards_inside_documents_match_torch_path_and_reference(kind, world):
    """Every (q shard, k/v shard) pair of a layout, ``doc_start`` the q shard's rows' global starts, the Triton side
    on what the ring's step runs (the shard's columns and the offsets that reach it, ``ring.shard_index``): each pair
    matches the PyTorch path on the same maps, and the merge over k/v shards (out, lse, dq) and the sum over q shards
    (dk, dv) match the reference on the whole sequence."""
    bs, hq, hkv = 64, 2, 1
    extra = 64 * (world == 3)  # W = 3 splits 576 tokens evenly, not 512
    layout = make_layout(kind, world, 512 + extra, block_size=bs)
    n = layout.padded_len
    docs = _documents([[3, 130, 64, 1, 250, 64 + extra], [200, 312 + extra]])
    b = docs.batch
    gen = torch.Generator().manual_seed(9)
    q, k, v = make_inputs(b, n, hq, hkv, D, torch.float32, gen)
    do = torch.randn(q.shape, generator=gen).to(DEVICE)
    index = random_index(b, hq, n, bs, num_cols=24, num_offsets=6, gen=gen)
    scale = D**-0.5
    ref = _reference(q, k, v, do, index, docs, scale, torch.float64)
    lim_out, lim_lse, lim_dq, lim_dk, lim_dv = _limits(q, k, v, do, index, docs, scale, torch.float32, ref)
    on_device = _moved(index)
    blocks = [layout.block_ids(r).to(DEVICE) for r in range(world)]
    maps = [prepare_tile_map(x, n // bs) for x in blocks]
    form, owner = on_device.kernel_index(n), layout.block_owner_on(DEVICE)
    steps = [[shard_index(on_device, owner, range(kr, kr + 1), form, offset_shards(layout, r, DEVICE), maps[kr])
              for kr in range(world)] for r in range(world)]  # fmt: skip
    qs, ks, vs, dos, starts = (
        [layout.shard(x, r) for r in range(world)] for x in (q, k, v, do, docs.starts.to(DEVICE))
    )

    outs, lses = [], []
    for r in range(world):
        out = torch.zeros(b, layout.local_len, hq, D, device=DEVICE)
        lse = torch.full((b, hq, layout.local_len), float("-inf"), device=DEVICE)
        out_t, lse_t = out.clone(), lse.clone()
        for s in range(world):
            kr = (r + 1 + s) % world
            shards = (qs[r], ks[kr], vs[kr], on_device, scale)
            vertical_slash_forward(
                *shards[:3], steps[r][kr], scale, out=out, lse=lse, q_blocks=maps[r], kv_blocks=maps[kr],
                doc_start=starts[r],
            )  # fmt: skip
            torch_path.vertical_slash_forward(
                *shards, out=out_t, lse=lse_t, q_blocks=blocks[r], kv_blocks=blocks[kr], doc_start=starts[r]
            )  # fmt: skip
            assert max_err(out, out_t) <= lim_out, f"out q{r} after kv{kr}"
            finite = torch.isfinite(lse_t)
            assert torch.equal(torch.isfinite(lse), finite), f"rows with no key differ, q{r} after kv{kr}"
            assert max_err(lse[finite], lse_t[finite]) <= lim_lse, f"lse q{r} after kv{kr}"
        assert max_err(out, layout.shard(ref[0], r)) <= lim_out, f"out q{r}"
        assert max_err(lse, layout.shard(ref[1], r, dim=2)) <= lim_lse, f"lse q{r}"
        outs.append(out)
        lses.append(lse)

    grads = [[torch.zeros(x.shape, dtype=torch.float64) for x in shards] for shards in (qs, ks, vs)]
    for r in range(world):
        for kr in range(world):
            args = (dos[r], qs[r], ks[kr], vs[kr], outs[r], lses[r], on_device, scale)
            got = vertical_slash_backward(
                *args[:6], steps[r][kr], scale, q_blocks=maps[r], kv_blocks=maps[kr], doc_start=starts[r]
            )
            want = torch_path.vertical_slash_backward(
                *args, q_blocks=blocks[r], kv_blocks=blocks[kr], doc_start=starts[r]
            )  # fmt: skip
            for name, x, y, lim in zip(("dq", "dk", "dv"), got, want, (lim_dq, lim_dk, lim_dv)):
                assert max_err(x, y) <= lim, f"{name} q{r} kv{kr}"
            for acc, x, at in zip(grads, got, (r, kr, kr)):
                acc[at] += x.cpu().double()
    for r in range(world):
        for name, acc, want, lim in zip(("dq", "dk", "dv"), grads, ref[2:], (lim_dq, lim_dk, lim_dv)):
            assert max_err(acc[r], layout.shard(want, r)) <= lim, f"{name} shard {r}"


@pytest.mark.parametrize(("kind", "world"), [("striped", 3), ("zigzag", 2)])
def test_gathered_shards_inside_documents_match_torch_path_and_reference(kind, world):
    """One call over every k/v shard laid end to end (a whole all-gathered ring group), its index as the ring builds
    it: the dk/dv pass walks each shard's own offsets, cut to the longest list the layout allows and counted per key
    tile up to the last query tile that the documents let reach it. Each rank's call matches the PyTorch path on the
    same maps; out, lse and dq per rank, and dk / dv summed over the ranks, match the reference."""
    bs, hq, hkv = 64, 2, 1
    extra = 64 * (world == 3)
    layout = make_layout(kind, world, 512 + extra, block_size=bs)
    n, nb = layout.padded_len, layout.padded_len // bs
    docs = _documents([[3, 130, 64, 1, 250, 64 + extra], [200, 312 + extra]])
    gen = torch.Generator().manual_seed(10)
    q, k, v = make_inputs(docs.batch, n, hq, hkv, D, torch.float32, gen)
    do = torch.randn(q.shape, generator=gen).to(DEVICE)
    index = random_index(docs.batch, hq, n, bs, num_cols=24, num_offsets=6, gen=gen)
    scale = D**-0.5
    ref = _reference(q, k, v, do, index, docs, scale, torch.float64)
    limits = dict(zip(NAMES, _limits(q, k, v, do, index, docs, scale, torch.float32, ref)))
    on_device = _moved(index)
    form, owner = on_device.kernel_index(n), layout.block_owner_on(DEVICE)
    srcs = range(world)
    blocks = torch.cat([layout.block_ids(s) for s in srcs]).to(DEVICE)
    kv_map = prepare_tile_map(blocks, nb)
    kv = [torch.cat([layout.shard(x, s) for s in srcs], dim=1) for x in (k, v)]
    dkv = [[torch.zeros(layout.shard(k, s).shape, dtype=torch.float64) for s in srcs] for _ in range(2)]
    for r in range(world):
        reaching = offsets_reaching(layout, r)
        width = 1 + max(reaching)
        step = shard_index(on_device, owner, srcs, form, offset_shards(layout, r, DEVICE), kv_map, reaching)
        assert step.key_slash.shape[:2] == (world, docs.batch) and step.key_slash.shape[-1] <= width
        q_blocks = layout.block_ids(r).to(DEVICE)
        maps = {"q_blocks": prepare_tile_map(q_blocks, nb), "kv_blocks": kv_map}
        qr, dor, start = (layout.shard(x, r) for x in (q, do, docs.starts.to(DEVICE)))
        out, lse = vertical_slash_forward(qr, *kv, step, scale, doc_start=start, **maps)
        got = vertical_slash_backward(dor, qr, *kv, out, lse, step, scale, doc_start=start, **maps)
        want = torch_path.vertical_slash_backward(
            dor, qr, *kv, out, lse, on_device, scale, q_blocks=q_blocks, kv_blocks=blocks, doc_start=start
        )
        for name, x, y in zip(NAMES[2:], got, want):
            assert max_err(x, y) <= limits[name], f"{name} q{r}"
        for name, x, full in zip(NAMES[:3], (out, lse, got[0]), ref[:3]):
            assert max_err(x, layout.shard(full, r, dim=2 if name == "lse" else 1)) <= limits[name], f"{name} q{r}"
        for acc, x in zip(dkv, got[1:]):
            for j in srcs:
                acc[j] += x[:, j * layout.local_len : (j + 1) * layout.local_len].cpu().double()
    for name, acc, full in zip(NAMES[3:], dkv, ref[3:]):
        for s in srcs:
            assert max_err(acc[s], layout.shard(full, s)) <= limits[name], f"{name} shard {s}"


def test_last_query_tiles():
    """The last query tile whose first row's document starts at or before each key block's last key; on shards,
    over the q shard's tiles only (in any local order), -1 where none reaches."""
    bs = 4
    # Documents [0, 6), [6, 7), [7, 16): tile first rows 0, 4, 8, 12 start at 0, 0, 7, 7.
    docs = _documents([[6, 1, 9]])
    starts = docs.starts.to(torch.int32)
    assert last_query_tiles(starts, bs, 4, None).tolist() == [[1, 3, 3, 3]]
    # A shard holding global blocks 3 and 1 (local tiles 0, 1), their rows' starts (7 and 0).
    shard = torch.cat([starts[:, 12:16], starts[:, 4:8]], dim=1)
    q_map = prepare_tile_map(torch.tensor([3, 1]), 4)
    assert last_query_tiles(shard, bs, 4, q_map).tolist() == [[1, 3, 3, 3]]
    # A shard holding only block 3 (first row's start 7): key block 0 (keys 0..3) reaches no query tile of it.
    only = last_query_tiles(starts[:, 12:16], bs, 4, prepare_tile_map(torch.tensor([3]), 4))
    assert only.tolist() == [[-1, 3, 3, 3]]


def test_doc_start_of_other_rows_is_rejected():
    q = torch.zeros(1, 64, 2, D)
    index = VerticalSlashIndex.dense(1, 2, 64, 64)
    with pytest.raises(ValueError, match=r"vertical_slash_forward: doc_start must be an integer tensor \[B, N\]"):
        vertical_slash_forward(q, q, q, index, 0.125, doc_start=torch.zeros(1, 32, dtype=torch.long))
    with pytest.raises(ValueError, match="got torch.float32"):
        vertical_slash_forward(q, q, q, index, 0.125, doc_start=torch.zeros(1, 64))
