"""The PyTorch path of vertical_slash_attention against the float64 reference of docs/design.md's index semantics."""

import pytest
import torch
import torch.nn.functional as F

from ds_mtraining.sparse import (
    AttentionPattern,
    VerticalSlashIndex,
    index_to_dense_mask,
    merge_attention_,
    reference_attention,
    torch_path,
    vertical_slash_attention,
    vertical_slash_attention_naive,
)


def _inputs(b, n, hq, hkv, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, hq, d, generator=gen).to(dtype)
    k = torch.randn(b, n, hkv, d, generator=gen).to(dtype)
    v = torch.randn(b, n, hkv, d, generator=gen).to(dtype)
    dout = torch.randn(b, n, hq, d, generator=gen).to(dtype)
    return q, k, v, dout


def _random_index(b, hq, n, bs, n_vertical, n_slash, seed):
    gen = torch.Generator().manual_seed(seed + 1)
    nb = -(-n // bs)
    vertical = torch.randint(-1, n, (b, hq, n_vertical), generator=gen)
    slash = torch.randint(-1, nb, (b, hq, n_slash), generator=gen)
    return VerticalSlashIndex.build(vertical, slash, bs)


def _forward_backward(fn, q, k, v, dout, dtype):
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    out, lse = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
    return (out, lse, *grads)


def _check_against_reference(q, k, v, dout, index, n):
    """Ours vs the fp64 reference (the naive op of the same signature); the error may be a small multiple of a
    same-dtype naive baseline's."""
    pattern = AttentionPattern(n, index)
    ours = _forward_backward(lambda *x: vertical_slash_attention(*x, pattern, return_lse=True), q, k, v, dout, q.dtype)
    naive = lambda *x: vertical_slash_attention_naive(*x, pattern, return_lse=True)  # noqa: E731
    ref = _forward_backward(naive, q, k, v, dout, torch.float64)
    base = _forward_backward(naive, q, k, v, dout, q.dtype)
    atol = 1e-5 if q.dtype == torch.float32 else 1e-3
    for name, o, r, bl in zip(("out", "lse", "dq", "dk", "dv"), ours, ref, base):
        assert o.dtype == (torch.float32 if name == "lse" else q.dtype), name
        err = (o.double() - r).abs().max().item()
        base_err = (bl.double() - r).abs().max().item()
        assert err <= 2 * base_err + atol, f"{name}: error {err:.3g} vs same-dtype baseline {base_err:.3g}"


CASES = [
    pytest.param(2, 200, 4, 4, 64, 64, id="mha-partial-block"),
    pytest.param(2, 256, 4, 2, 64, 64, id="gqa2"),
    pytest.param(1, 300, 8, 2, 128, 128, id="gqa4-d128-bs128"),
    pytest.param(2, 130, 7, 1, 64, 64, id="gqa7"),
    pytest.param(3, 64, 2, 1, 128, 64, id="single-block"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("b,n,hq,hkv,d,bs", CASES)
def test_matches_reference(b, n, hq, hkv, d, bs, dtype):
    q, k, v, dout = _inputs(b, n, hq, hkv, d, dtype, seed=n + hq)
    index = _random_index(b, hq, n, bs, n_vertical=12, n_slash=3, seed=n)
    _check_against_reference(q, k, v, dout, index, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_empty_vertical_set(dtype):
    b, n, hq, hkv, d, bs = 2, 190, 4, 2, 64, 64
    q, k, v, dout = _inputs(b, n, hq, hkv, d, dtype, seed=3)
    index = VerticalSlashIndex.build(torch.full((b, hq, 4), -1), torch.tensor([1, 2]).expand(b, hq, 2), bs)
    _check_against_reference(q, k, v, dout, index, n)


def test_tolerance_catches_a_dropped_column():
    """The tolerance above is tight enough that attending one column too few fails it."""
    b, n, hq, hkv, d, bs = 1, 200, 2, 2, 64, 64
    q, k, v, dout = _inputs(b, n, hq, hkv, d, torch.float32, seed=5)
    index = VerticalSlashIndex.build(torch.tensor([[[10, 150], [20, -1]]]), torch.tensor([[[0], [0]]]), bs)
    fewer = VerticalSlashIndex.build(torch.tensor([[[10, -1], [20, -1]]]), torch.tensor([[[0], [0]]]), bs)
    out = vertical_slash_attention(q, k, v, AttentionPattern(n, fewer))
    ref, _ = reference_attention(q.double(), k.double(), v.double(), index_to_dense_mask(index, n))
    assert (out.double() - ref).abs().max().item() > 2e-5 + 1e-5


@pytest.mark.parametrize("n,bs", [(256, 64), (250, 128)], ids=["exact", "partial"])
def test_covering_everything_equals_dense(n, bs):
    """Every column and every offset: each causal entry is attended exactly once, as in dense attention."""
    b, hq, hkv, d = 2, 4, 2, 64
    q, k, v, dout = _inputs(b, n, hq, hkv, d, torch.float32, seed=7)
    nb = -(-n // bs)
    index = VerticalSlashIndex.build(torch.arange(n).expand(b, hq, n), torch.arange(nb).expand(b, hq, nb), bs)
    pattern = AttentionPattern(n, index)
    ours = _forward_backward(lambda *x: (vertical_slash_attention(*x, pattern), None), q, k, v, dout, torch.float32)
    sdpa = _forward_backward(lambda *x: (vertical_slash_attention(*x, None), None), q, k, v, dout, torch.float32)
    expect = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(sdpa[0], expect)
    for name, o, s in zip(("out", "-", "dq", "dk", "dv"), ours, sdpa):
        if o is not None:
            torch.testing.assert_close(o, s, atol=2e-5, rtol=1e-4, msg=name)


def test_dense_with_lse_matches_reference():
    b, n, hq, hkv, d = 1, 150, 4, 1, 64
    q, k, v, dout = _inputs(b, n, hq, hkv, d, torch.float32, seed=9)
    out, lse = vertical_slash_attention(q, k, v, None, return_lse=True)
    causal = torch.ones(n, n, dtype=torch.bool).tril().expand(b, hq, n, n)
    ref_out, ref_lse = reference_attention(q.double(), k.double(), v.double(), causal)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=0)


def test_softmax_scale_is_applied():
    b, n, hq, d, bs = 1, 128, 2, 64, 64
    q, k, v, dout = _inputs(b, n, hq, hq, d, torch.float32, seed=11)
    index = _random_index(b, hq, n, bs, 5, 2, seed=1)
    out = vertical_slash_attention(q, k, v, AttentionPattern(n, index), softmax_scale=0.3)
    ref, _ = reference_attention(q.double(), k.double(), v.double(), index_to_dense_mask(index, n), 0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("scale", [0.0, -0.3, float("nan"), float("inf")])
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense-sdpa"])
def test_rejects_a_scale_that_is_not_positive(scale, sparse):
    """On every device: the Triton kernels need a positive scale, so the CPU path refuses the same inputs."""
    q, k, v, _ = _inputs(1, 128, 2, 2, 64, torch.float32, seed=3)
    pattern = AttentionPattern(128, _random_index(1, 2, 128, 64, 5, 2, seed=1)) if sparse else None
    with pytest.raises(ValueError, match=r"vertical_slash_attention: softmax_scale must be a positive finite.*None"):
        vertical_slash_attention(q, k, v, pattern, softmax_scale=scale)


@pytest.mark.parametrize("launcher", ["vertical_slash_forward", "vertical_slash_backward"])
def test_the_pytorch_launchers_check_the_scale_as_the_triton_ones(launcher):
    """A ring step calls a backend's launchers directly: on the CPU a scale the Triton kernels refuse is refused too,
    in the same words, and None is 1 / sqrt(D)."""
    q, k, v, dout = _inputs(1, 128, 2, 2, 64, torch.float32, seed=3)
    index = _random_index(1, 2, 128, 64, 5, 2, seed=1)
    out, lse = torch_path.vertical_slash_forward(q, k, v, index, 64**-0.5)
    args = (q, k, v, index) if launcher == "vertical_slash_forward" else (dout, q, k, v, out, lse, index)
    call = getattr(torch_path, launcher)
    with pytest.raises(ValueError, match=rf"^{launcher}: softmax_scale must be a positive finite number; got -0.3"):
        call(*args, -0.3)
    for got, want in zip(call(*args), call(*args, 64**-0.5), strict=True):
        assert torch.equal(got, want)


def test_both_backends_take_the_same_launcher_parameters():
    """The kernel form the ring and one device share (docs/design.md, "The kernel form"): the PyTorch path and the
    Triton kernels expose the same launchers with the same parameters, kinds and defaults, so a caller (the ring's
    steps, ``benchmarks.ring_steps``) runs either by the same call, and a new kernel family has one list to meet."""
    import inspect

    triton_backend = pytest.importorskip("ds_mtraining.sparse.triton")
    for name in ("vertical_slash_forward", "vertical_slash_backward", "backward_delta", "forward_op", "backward_op",
                 "index_tensors"):  # fmt: skip
        want, got = (inspect.signature(getattr(m, name)).parameters for m in (triton_backend, torch_path))
        assert [(p.name, p.kind, p.default) for p in got.values()] == [
            (p.name, p.kind, p.default) for p in want.values()
        ], name


def test_merge_of_disjoint_key_sets_equals_whole():
    """merge_attention_ of two disjoint masks equals attention over their union, empty rows included."""
    b, n, hq, d = 2, 96, 3, 32
    q, k, v, _ = _inputs(b, n, hq, hq, d, torch.float64, seed=13)
    gen = torch.Generator().manual_seed(0)
    causal = torch.ones(n, n, dtype=torch.bool).tril().expand(b, hq, n, n)
    part = torch.rand(b, hq, n, n, generator=gen) < 0.5
    first, second = causal & part, causal & ~part
    first[:, :, :5] = False  # rows whose first part is empty
    whole, whole_lse = reference_attention(q, k, v, first | second)
    out = torch.zeros(b, n, hq, d, dtype=torch.float64)
    lse = torch.full((b, hq, n), float("-inf"), dtype=torch.float64)
    for mask in (first, second):
        merge_attention_(out, lse, *reference_attention(q, k, v, mask))
    torch.testing.assert_close(out, whole)
    torch.testing.assert_close(lse, whole_lse)


def test_forward_merges_into_running_output():
    """The launcher's accumulate form (used by ring steps) equals the plain call when started empty."""
    b, n, hq, hkv, d, bs = 2, 200, 4, 2, 64, 64
    q, k, v, _ = _inputs(b, n, hq, hkv, d, torch.float32, seed=15)
    index = _random_index(b, hq, n, bs, 8, 3, seed=2)
    out, lse = torch_path.vertical_slash_forward(q, k, v, index, 0.125)
    acc_out = torch.zeros(b, n, hq, d)
    acc_lse = torch.full((b, hq, n), float("-inf"))
    torch_path.vertical_slash_forward(q, k, v, index, 0.125, out=acc_out, lse=acc_lse)
    torch.testing.assert_close(acc_out, out)
    torch.testing.assert_close(acc_lse, lse)


def test_backward_is_deterministic():
    b, n, hq, hkv, d, bs = 1, 256, 4, 1, 64, 64
    q, k, v, dout = _inputs(b, n, hq, hkv, d, torch.float32, seed=17)
    pattern = AttentionPattern(n, _random_index(b, hq, n, bs, 20, 3, seed=3))
    runs = [
        _forward_backward(lambda *x: (vertical_slash_attention(*x, pattern), None), q, k, v, dout, torch.float32)
        for _ in range(2)
    ]
    for first, second in zip(runs[0][2:], runs[1][2:]):
        assert torch.equal(first, second)


def _bad_call_cases():
    q = torch.randn(1, 128, 4, 64)
    k = torch.randn(1, 128, 2, 64)
    index = VerticalSlashIndex.build(torch.tensor([[[3]] * 4]), torch.zeros(1, 4, 1, dtype=torch.long), 64)
    good = AttentionPattern(128, index)
    return [
        pytest.param((q[0], k[0], k[0], good), "must be \\[B, N, H, D\\]", id="3d"),
        pytest.param((q, k, k[..., :32], good), "same shape", id="k-v-shapes"),
        pytest.param((q, k[:, :64], k[:, :64], good), "agree on B, N and D", id="seqlen"),
        pytest.param((q, torch.randn(1, 128, 3, 64), torch.randn(1, 128, 3, 64), good), "multiple of", id="gqa"),
        pytest.param((q, k.half(), k.half(), good), "one float dtype", id="dtype"),
        pytest.param((q[:, :, :2], k, k, good), "per query head", id="index-heads"),
        pytest.param(
            (
                q,
                k,
                k,
                AttentionPattern(
                    128,
                    VerticalSlashIndex.build(torch.tensor([[[500]] * 4]), torch.zeros(1, 4, 1, dtype=torch.long), 64),
                ),
            ),
            "out of range",
            id="index-range",
        ),
        pytest.param((q, k, k, index), "pattern must be an AttentionPattern", id="bare-index"),
        pytest.param(
            (q, k, k, AttentionPattern(64, index)),
            "the pattern is for rows of 64 tokens but q has 128",
            id="pattern-seqlen",
        ),
    ]


@pytest.mark.parametrize("args,message", _bad_call_cases())
def test_bad_input_is_rejected(args, message):
    with pytest.raises(ValueError, match=message):
        vertical_slash_attention(*args)


def test_check_index_false_skips_only_the_validation(monkeypatch):
    """``check_index=False`` (what the model integration passes for the estimators' indices) skips the
    host-syncing ``validate``, with the same result; the default validates; the cheap checks stay on."""
    b, n, hq, hkv, d, bs = 1, 200, 4, 2, 64, 64
    q, k, v, _ = _inputs(b, n, hq, hkv, d, torch.float32, seed=5)
    pattern = AttentionPattern(n, _random_index(b, hq, n, bs, 10, 2, seed=5))
    want = vertical_slash_attention(q, k, v, pattern)
    calls = []
    monkeypatch.setattr(VerticalSlashIndex, "validate", lambda self, seqlen: calls.append(seqlen))
    got = vertical_slash_attention(q, k, v, pattern, check_index=False)
    assert calls == []
    assert torch.equal(got, want)
    vertical_slash_attention(q, k, v, pattern)
    assert calls == [n]
    with pytest.raises(ValueError, match="per query head"):
        vertical_slash_attention(q[:, :, :2], k, v, pattern, check_index=False)


def test_naive_op_is_the_index_contract():
    """The naive op of ``vertical_slash_attention``'s signature: dense causal for ``pattern=None`` (SDPA, float64), the
    index's mask, and causal-inside-documents for packed rows."""
    from ds_mtraining.sparse import Documents

    q, k, v, _ = _inputs(2, 96, 4, 2, 32, torch.float64, seed=11)
    sdpa = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(vertical_slash_attention_naive(q, k, v, None), sdpa, rtol=0, atol=1e-12)
    index = _random_index(2, 4, 96, 32, 5, 2, seed=11)
    out, lse = vertical_slash_attention_naive(q, k, v, AttentionPattern(96, index), return_lse=True, softmax_scale=0.3)
    ref_out, ref_lse = reference_attention(q, k, v, index_to_dense_mask(index, 96), 0.3)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    documents = Documents.from_cu_seqlens(torch.tensor([[0, 40, 96], [0, 54, 96]]), 96)
    dense_docs = vertical_slash_attention_naive(q, k, v, AttentionPattern(96, documents=documents))
    torch.testing.assert_close(dense_docs, reference_attention(q, k, v, documents.mask()[:, None])[0], rtol=0, atol=0)
