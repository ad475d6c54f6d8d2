"""Packed documents (issue 26): the ``Documents`` constructors, the document-masked reference, and attention inside
documents (dense, and through an index on the PyTorch path; the Triton kernels: test_documents_triton.py) in float64
against references built from the semantics of docs/design.md: attend(i, j) = doc_start[i] <= j <= i and (j in V or
i // bs - j // bs in S)."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask

from ds_mtraining.sparse import (
    AttentionPattern,
    Documents,
    VerticalSlashIndex,
    index_to_dense_mask,
    reference_attention,
    torch_path,
    vertical_slash_attention,
)
from ds_mtraining.sparse import attention as attention_module

BS = 16
TOL = 1e-10  # float64 against float64: only the summation order differs


def _lengths_to_cu(lengths: list[list[int]]) -> torch.Tensor:
    """Per-row document lengths as a ``[B, D + 1]`` cu_seqlens, short rows padded by repeating their end."""
    width = max(len(row) for row in lengths) + 1
    rows = []
    for row in lengths:
        cu = torch.tensor([0, *row]).cumsum(0)
        rows.append(torch.cat([cu, cu[-1:].expand(width - len(cu))]))
    return torch.stack(rows)


def _documents(lengths: list[list[int]]) -> Documents:
    return Documents.from_cu_seqlens(_lengths_to_cu(lengths), sum(lengths[0]))


def _inputs(b, n, hq, hkv, d, seed):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, n, h, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv, hq))


def _random_index(b, hq, n, n_vertical, n_slash, seed):
    gen = torch.Generator().manual_seed(seed + 1)
    vertical = torch.randint(-1, n, (b, hq, n_vertical), generator=gen)
    slash = torch.randint(-1, -(-n // BS), (b, hq, n_slash), generator=gen)
    return VerticalSlashIndex.build(vertical, slash, BS)


def _forward_backward(fn, q, k, v, dout):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = fn(q, k, v)
    return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))


def _assert_close(ours, ref, names=("out", "lse", "dq", "dk", "dv")):
    for name, o, r in zip(names, ours, ref):
        assert o.dtype == torch.float64, name
        err = (o - r).abs().max().item()
        assert err <= TOL, f"{name}: max error {err:.3g}"


# Document lengths per row; every row sums to the same N. Lengths 1, bs - 1, bs, bs + 1 put the boundaries at every
# phase of the tiles (a document starting mid-tile cuts its first tile like the causal diagonal).
LAYOUTS = [
    pytest.param([[1] * 40], id="len1"),
    pytest.param([[BS - 1] * 5], id="len-bs-1"),
    pytest.param([[BS] * 5], id="len-bs"),
    pytest.param([[BS + 1] * 5], id="len-bs+1"),
    pytest.param([[1, BS - 1, BS, BS + 1, 3, 2 * BS + 1, 10]], id="mixed"),
    pytest.param([[5, 40, 20, 30], [BS, BS, 1, 62], [95]], id="batch3-own-boundaries"),
]
HEADS = [pytest.param(4, 4, id="mha"), pytest.param(4, 2, id="gqa2"), pytest.param(6, 1, id="gqa6")]


def test_mask_matches_the_semantics_entry_by_entry():
    lengths = [[3, BS + 2, 1, 11], [BS - 1, 2, 1, 15]]
    docs, n = _documents(lengths), 33
    index = _random_index(2, 3, n, n_vertical=7, n_slash=2, seed=5)
    mask = AttentionPattern(n, index, docs).dense_mask()
    columns, offsets = index.column_mask(n), index.offset_mask(n)
    for b in range(2):
        for h in range(3):
            for i in range(n):
                for j in range(n):
                    doc = int(docs.starts[b, i])
                    want = doc <= j <= i and bool(columns[b, h, j] or offsets[b, h, i // BS - j // BS])
                    assert bool(mask[b, h, i, j]) == want, (b, h, i, j)


@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("lengths", LAYOUTS)
def test_index_inside_documents_matches_reference(lengths, hq, hkv):
    docs = _documents(lengths)
    b, n = docs.starts.shape
    q, k, v, dout = _inputs(b, n, hq, hkv, 8, seed=n + hq)
    pattern = AttentionPattern(n, _random_index(b, hq, n, n_vertical=9, n_slash=3, seed=n), docs)
    mask = pattern.dense_mask()
    ours = _forward_backward(lambda *x: vertical_slash_attention(*x, pattern, return_lse=True), q, k, v, dout)
    _assert_close(ours, _forward_backward(lambda *x: reference_attention(*x, mask), q, k, v, dout))


def _in_document_density(index: VerticalSlashIndex, n: int, docs: Documents) -> torch.Tensor:
    """The reference density: attended in-document entries of the dense mask over the in-document causal entries
    (the document mask's), both counted in int64, float64 ``[B, Hq]``."""
    attended = AttentionPattern(n, index, docs).dense_mask().sum((-1, -2)).double()
    return attended / docs.mask().sum((-1, -2)).double()[:, None]


@pytest.mark.parametrize("lengths", LAYOUTS)
def test_density_inside_documents_is_exact(lengths):
    """Fresh random indices (columns and offsets in every document) against the dense mask, exactly; the
    denominator is also Σ L (L + 1) / 2 of the lengths."""
    docs = _documents(lengths)
    b, n = docs.starts.shape
    for seed in range(3):
        index = _random_index(b, 4, n, n_vertical=12, n_slash=4, seed=100 * seed + n)
        got = AttentionPattern(n, index, docs).density()
        torch.testing.assert_close(got, _in_document_density(index, n, docs), rtol=0, atol=0)
    causal = torch.tensor([sum(x * (x + 1) // 2 for x in row) for row in lengths], dtype=torch.float64)
    assert torch.equal(docs.causal_entries(), causal)
    # The all-offsets index attends every in-document causal entry.
    dense = AttentionPattern(n, VerticalSlashIndex.dense(b, 3, n, BS), docs)
    assert torch.equal(dense.density(), torch.ones(b, 3, dtype=torch.float64))


def test_density_inside_random_documents_and_block_sizes():
    """Random boundaries per row (B = 3), block sizes 1 .. 9, lengths with and without a partial last block, no
    columns at all, and many columns."""
    gen = torch.Generator().manual_seed(7)
    for trial in range(40):
        bs, n = int(torch.randint(1, 10, (1,), generator=gen)), int(torch.randint(1, 90, (1,), generator=gen))
        p = (0.05, 0.3, 0.7)[trial % 3]  # long documents, short ones, mostly single tokens
        docs = Documents.from_document_ids((torch.rand(3, n, generator=gen) < p).cumsum(-1))
        nb = -(-n // bs)
        kv = (0, 3, 20)[trial % 3]
        vertical = torch.randint(-1, n, (3, 2, kv), generator=gen)
        slash = torch.randint(-1, nb, (3, 2, int(torch.randint(1, 6, (1,), generator=gen))), generator=gen)
        index = VerticalSlashIndex.build(vertical, slash, bs)
        got, want = AttentionPattern(n, index, docs).density(), _in_document_density(index, n, docs)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"trial {trial}: n={n}, bs={bs}")


@pytest.mark.parametrize("n", [40, 80, 95, 5], ids=["partial", "exact", "partial-95", "one-block"])
def test_density_with_one_document_per_row_is_the_plain_density(n):
    index = _random_index(2, 4, n, n_vertical=12, n_slash=4, seed=n)
    one = Documents(torch.zeros(2, n, dtype=torch.long))
    assert torch.equal(AttentionPattern(n, index, one).density(), index.density(n))


def test_density_rejects_documents_of_other_rows():
    # The density inside documents is the pattern's: the pattern refuses documents of other rows than its index's.
    index = _random_index(2, 2, 32, n_vertical=3, n_slash=2, seed=0)
    with pytest.raises(
        ValueError, match=r"documents are \[B, N\] = \[1, 32\] but the pattern's index has batch=2"
    ):  # fmt: skip
        AttentionPattern(32, index, _documents([[16, 16]])).density()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_low_precision_error_is_a_small_multiple_of_the_baseline(dtype):
    """fp32 / bf16 against the float64 reference: within twice the error of the same-dtype dense baseline."""
    docs = _documents([[1, BS - 1, BS, BS + 1, 3, 2 * BS + 1, 10], [5, 40, 20, 30]])
    q, k, v, dout = _inputs(2, 95, 4, 2, 16, seed=8)
    pattern = AttentionPattern(95, _random_index(2, 4, 95, n_vertical=9, n_slash=3, seed=8), docs)
    mask = pattern.dense_mask()
    low = [x.to(dtype) for x in (q, k, v, dout)]
    ours = _forward_backward(lambda *x: vertical_slash_attention(*x, pattern, return_lse=True), *low)
    base = _forward_backward(lambda *x: reference_attention(*x, mask), *low)
    ref = _forward_backward(lambda *x: reference_attention(*x, mask), q, k, v, dout)
    atol = 1e-5 if dtype == torch.float32 else 1e-3
    for name, o, bl, r in zip(("out", "lse", "dq", "dk", "dv"), ours, base, ref):
        err, base_err = ((x.double() - r).abs().max().item() for x in (o, bl))
        assert err <= 2 * base_err + atol, f"{name}: error {err:.3g} vs same-dtype baseline {base_err:.3g}"


def _per_document(q, k, v, docs: Documents):
    """Causal SDPA run separately on every document of every row, stitched back: out ``[B, N, Hq, D]``."""
    rows = []
    for b in range(docs.batch):
        starts = docs.starts[b]
        bounds = [*torch.nonzero(starts == torch.arange(docs.seqlen)).flatten().tolist(), docs.seqlen]
        parts = []
        for lo, hi in itertools.pairwise(bounds):
            x = [t[b : b + 1, lo:hi].transpose(1, 2) for t in (q, k, v)]
            parts.append(F.scaled_dot_product_attention(*x, is_causal=True, enable_gqa=True).transpose(1, 2))
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows, dim=0)


@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("lengths", LAYOUTS)
def test_dense_inside_documents_equals_each_document_alone(lengths, hq, hkv):
    docs = _documents(lengths)
    b, n = docs.starts.shape
    q, k, v, dout = _inputs(b, n, hq, hkv, 8, seed=3 * n + hq)
    names = ("out", "dq", "dk", "dv")
    alone = _forward_backward(lambda *x: (_per_document(*x, docs), None), q, k, v, dout)
    alone = alone[:1] + alone[2:]
    pattern = AttentionPattern(n, documents=docs)
    sdpa = _forward_backward(lambda *x: (vertical_slash_attention(*x, pattern), None), q, k, v, dout)
    _assert_close(sdpa[:1] + sdpa[2:], alone, names)
    # With the lse, the dense index on the PyTorch path: its lse against the reference's.
    with_lse = _forward_backward(
        lambda *x: vertical_slash_attention(*x, pattern, return_lse=True), q, k, v, dout
    )
    _assert_close(with_lse[:1] + with_lse[2:], alone, names)
    _, ref_lse = reference_attention(q, k, v, docs.mask()[:, None])
    _assert_close(with_lse[1:2], [ref_lse], ("lse",))


def test_documents_of_length_one_return_their_own_value():
    docs = _documents([[1] * 20, [1] * 20])
    q, k, v, _ = _inputs(2, 20, 4, 2, 8, seed=1)
    index = _random_index(2, 4, 20, n_vertical=5, n_slash=2, seed=1)
    out = vertical_slash_attention(q, k, v, AttentionPattern(20, index, docs))
    torch.testing.assert_close(out, v.repeat_interleave(2, dim=2), rtol=0, atol=TOL)


def test_one_document_per_row_is_plain_causal_attention():
    n = 70
    docs = Documents(torch.zeros(2, n, dtype=torch.long))
    q, k, v, dout = _inputs(2, n, 4, 2, 8, seed=2)
    index = _random_index(2, 4, n, n_vertical=6, n_slash=2, seed=2)
    plain_pattern, docs_pattern = AttentionPattern(n, index), AttentionPattern(n, index, docs)
    plain = _forward_backward(lambda *x: vertical_slash_attention(*x, plain_pattern, return_lse=True), q, k, v, dout)
    docs_run = _forward_backward(
        lambda *x: vertical_slash_attention(*x, docs_pattern, return_lse=True), q, k, v, dout
    )  # fmt: skip
    _assert_close(docs_run, plain)
    assert torch.equal(docs_pattern.dense_mask(), index_to_dense_mask(index, n))


def test_precomputed_output_gets_the_gradients_inside_documents():
    # An activation checkpoint's recomputation passes the forward's (out, lse): the backward must still see documents.
    docs = _documents([[7, BS + 1, 40]])
    q, k, v, dout = _inputs(1, 64, 4, 2, 8, seed=6)
    pattern = AttentionPattern(64, _random_index(1, 4, 64, n_vertical=6, n_slash=2, seed=6), docs)
    first = _forward_backward(lambda *x: vertical_slash_attention(*x, pattern, return_lse=True), q, k, v, dout)
    kept = first[:2]
    again = _forward_backward(
        lambda *x: vertical_slash_attention(*x, pattern, return_lse=True, precomputed=kept),
        q, k, v, dout,
    )  # fmt: skip
    for name, a, b in zip(("dq", "dk", "dv"), again[2:], first[2:]):
        assert torch.equal(a, b), name


def test_tiles_outside_every_document_are_not_gathered():
    # Documents of one tile each, aligned: only the diagonal tile is left of the dense index; shifted by 3, the
    # previous tile too (it holds the document's first tokens).
    n, nb = 8 * BS, 8
    index = VerticalSlashIndex.dense(1, 2, n, BS)
    for lengths, width in (([BS] * 8, 1), ([3] + [BS] * 7 + [BS - 3], 2)):
        starts = _documents([lengths]).starts
        layout = torch_path._Layout(index, 2, n, n, None, None, starts)
        masks = layout.masks(0, nb)
        assert masks.tiles.shape[-1] == width and bool(masks.tile_ok[..., 0].all())


def test_columns_of_other_documents_are_not_gathered():
    # Four documents of two tiles, each with its first token as a column: a document's second tile reads its own
    # column (offset 1 is not chosen), its first tile holds it in the diagonal tile, no tile reads another's.
    n = 8 * BS
    columns = torch.arange(0, n, 2 * BS).expand(1, 2, 4)
    index = VerticalSlashIndex.build(columns, torch.zeros(1, 2, 1, dtype=torch.long), BS)
    layout = torch_path._Layout(index, 2, n, n, None, None, _documents([[2 * BS] * 4]).starts)
    assert [layout.masks(t, t + 1).col_order.shape[-1] for t in range(8)] == [0, 1] * 4


def test_ring_shards_compute_their_part_inside_documents():
    """The launchers on striped shards (global block j on rank j % 2, ``doc_start`` in global positions for each
    shard's rows), merged over the kv shards, give every row's output and gradients of the whole sequence."""
    docs = _documents([[5, 40, 20, 31], [BS, BS, 1, 63]])
    b, n = docs.starts.shape
    q, k, v, dout = _inputs(b, n, 4, 2, 8, seed=9)
    index = _random_index(b, 4, n, n_vertical=9, n_slash=3, seed=9)
    mask = AttentionPattern(n, index, docs).dense_mask()
    ref = _forward_backward(lambda *x: reference_attention(*x, mask), q, k, v, dout)
    blocks = [torch.arange(r, n // BS, 2) for r in range(2)]
    rows = [(blk[:, None] * BS + torch.arange(BS)).flatten() for blk in blocks]
    scale = 8**-0.5
    out, lse = torch.zeros_like(q), torch.full((b, 4, n), float("-inf"), dtype=torch.float64)
    for r in range(2):
        o, s = out[:, rows[r]], lse[..., rows[r]]
        for kr in range(2):
            torch_path.vertical_slash_forward(
                q[:, rows[r]], k[:, rows[kr]], v[:, rows[kr]], index, scale, out=o, lse=s, q_blocks=blocks[r],
                kv_blocks=blocks[kr], doc_start=docs.starts[:, rows[r]],
            )  # fmt: skip
        out[:, rows[r]], lse[..., rows[r]] = o, s
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    for r in range(2):
        for kr in range(2):
            dq, dk, dv = torch_path.vertical_slash_backward(
                dout[:, rows[r]], q[:, rows[r]], k[:, rows[kr]], v[:, rows[kr]], out[:, rows[r]], lse[..., rows[r]],
                index, scale, q_blocks=blocks[r], kv_blocks=blocks[kr], doc_start=docs.starts[:, rows[r]],
            )  # fmt: skip
            grads[0][:, rows[r]] += dq
            grads[1][:, rows[kr]] += dk
            grads[2][:, rows[kr]] += dv
    _assert_close((out, lse, *grads), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_torch_path_ops_with_documents_pass_opcheck(dtype):
    """Schema and fake kernels of the PyTorch path's ops with ``doc_start`` (what ``torch.compile`` traces)."""
    docs = _documents([[3, 30, 17], [BS + 1, 33]])
    q, k, v, do = (x.to(dtype) for x in _inputs(2, 50, 4, 2, 8, seed=4))
    index = _random_index(2, 4, 50, n_vertical=5, n_slash=2, seed=4)
    tensors = (index.vertical, index.slash, BS, 0.125, docs.starts)
    out, lse = torch_path.forward_op(q, k, v, *tensors)
    torch.library.opcheck(torch_path.forward_op, (q, k, v, *tensors))
    torch.library.opcheck(torch_path.backward_op, (do, q, k, v, out, lse, *tensors))


def test_flex_mask_mod_is_the_document_mask():
    docs = _documents([[3, BS + 2, 1, 11], [BS - 1, 2, 1, 15]])
    mask = create_mask(attention_module.document_mask_mod(docs), docs.batch, 1, docs.seqlen, docs.seqlen, "cpu")
    assert torch.equal(mask[:, 0], docs.mask())


# The constructors.


def test_constructors_agree():
    lengths = [[4, 1, 20, 7], [32], [BS, BS]]
    cu = _lengths_to_cu(lengths)
    document_ids = torch.stack([torch.arange(len(row)).repeat_interleave(torch.tensor(row)) for row in lengths])
    position_ids = torch.stack([torch.cat([torch.arange(x) for x in row]) for row in lengths])
    starts = torch.stack([torch.arange(32) - p for p in position_ids])
    for docs in (
        Documents.from_cu_seqlens(cu, 32),
        Documents.from_document_ids(document_ids),
        Documents.from_position_ids(position_ids),
        Documents.from_position_ids(position_ids + 1),  # models whose positions start at 1
    ):
        docs.validate()
        assert torch.equal(docs.starts, starts)
    one_row = Documents.from_cu_seqlens(torch.tensor([0, 4, 4, 5, 25, 32], dtype=torch.int32), 32)
    assert torch.equal(one_row.starts, starts[:1])


def test_position_ids_that_jump_start_a_document():
    # transformers' rule: a document starts wherever the position is not its predecessor's plus one.
    docs = Documents.from_position_ids(torch.tensor([[7, 8, 9, 0, 1, 5, 6, 6]]))
    assert docs.starts.tolist() == [[0, 0, 0, 3, 3, 5, 5, 7]]


@pytest.mark.parametrize(
    "cu,message",
    [
        pytest.param([0, 4, 9], "must end at seqlen=8", id="short"),
        pytest.param([1, 4, 8], "must start at 0", id="no-zero"),
        pytest.param([[0, 4, 8], [0, 5, 3]], r"row 1 \(\[0, 5, 3\]\) must end", id="row-1"),
        pytest.param([0, 6, 4, 8], "must not decrease", id="decreasing"),
    ],
)
def test_bad_cu_seqlens_are_rejected(cu, message):
    with pytest.raises(ValueError, match=message):
        Documents.from_cu_seqlens(torch.tensor(cu), 8)


@pytest.mark.parametrize(
    "make,message",
    [
        pytest.param(lambda: Documents.from_position_ids(torch.zeros(8)), r"\[B, N\] of position ids", id="1d"),
        pytest.param(lambda: Documents.from_document_ids(torch.zeros(1, 8)), "integer tensor", id="float"),
        pytest.param(lambda: Documents.from_cu_seqlens([0, 8], 8), "got list", id="list"),
        pytest.param(lambda: Documents(torch.zeros(1, 8, dtype=torch.int32)), "LongTensor", id="int32"),
    ],
)
def test_bad_constructor_input_is_rejected(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "starts,message",
    [
        pytest.param(
            [0, 0, 1, 1], r"starts\[0, 2\] = 1: expected 2 \(a new document\) or starts\[0, 1\] = 0", id="back"
        ),
        pytest.param([0, 0, 3, 2], r"starts\[0, 2\] = 3", id="ahead"),
        pytest.param([1, 1, 1, 1], r"starts\[0, 0\] = 1: expected 0", id="first"),
    ],
)
def test_validate_names_the_bad_token(starts, message):
    docs = Documents(torch.tensor([starts]))
    with pytest.raises(ValueError, match=message):
        docs.validate()
    q = torch.randn(1, 4, 2, 8)
    pattern = AttentionPattern(4, documents=docs)  # the constructor checks shapes only
    with pytest.raises(ValueError, match=message):
        pattern.validate()
    with pytest.raises(ValueError, match=message):
        vertical_slash_attention(q, q, q, pattern)
    vertical_slash_attention(q, q, q, pattern, check_index=False)  # the check is the only guard


def test_documents_for_other_rows_are_rejected():
    q = torch.randn(2, 16, 2, 8)
    docs = _documents([[16]])
    with pytest.raises(ValueError, match=r"\[1, 16\] but vertical_slash_attention's q has batch=2, seqlen=16"):
        vertical_slash_attention(q, q, q, AttentionPattern(16, documents=docs))
    with pytest.raises(ValueError, match="documents must be a Documents"):
        AttentionPattern(16, documents=torch.zeros(2, 16, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[1, 16\] but the pattern's index has batch=2, seqlen=16"):
        AttentionPattern(16, VerticalSlashIndex.dense(2, 2, 16, BS), docs).dense_mask()
    # Rows of another length: the pattern refuses documents of other rows than its own, the attention a pattern of
    # other rows than q's.
    with pytest.raises(ValueError, match="documents are for rows of 16 tokens but the pattern's seqlen is 32"):
        AttentionPattern(32, documents=docs)
    long_q = torch.randn(2, 32, 2, 8)
    with pytest.raises(ValueError, match="the pattern is for rows of 16 tokens but q has 32"):
        vertical_slash_attention(long_q, long_q, long_q, AttentionPattern(16, documents=_documents([[16]] * 2)))


def test_check_rows_names_the_mismatch_and_the_fix():
    docs = _documents([[100, 200], [300]])  # [2, 300]
    docs.check_rows(2, 300, "q")
    docs.check_rows(2, 300, "q", torch.device("cpu"))
    fix = r"build the Documents from the same rows \(Documents.from_position_ids\(position_ids\)\)"
    for batch, seqlen in ((1, 300), (2, 256)):
        with pytest.raises(
            ValueError,
            match=rf"^documents are \[B, N\] = \[2, 300\] but the q has batch={batch}, "
            rf"seqlen={seqlen}: {fix}$",
        ):
            docs.check_rows(batch, seqlen, "the q")
    with pytest.raises(ValueError, match=r"^documents are on cpu but the q is on meta: move them there"):
        docs.check_rows(2, 300, "the q", torch.device("meta"))
