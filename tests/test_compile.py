"""``vertical_slash_attention`` under ``torch.compile``: one graph, no breaks, the eager results.

On CPU the attention runs the PyTorch path's custom ops (``ds_mtraining::torch_vertical_slash_*``); the Triton ops
(``ds_mtraining::triton_vertical_slash_*``) run on CPU tensors through the interpreter (``conftest.py``), so their
fake kernels are checked here too: by ``torch.library.opcheck`` (shapes, dtypes and strides against the real
outputs) and by compiling the attention with the Triton backend forced for CPU tensors.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from ds_mtraining.sparse import AttentionPattern, VerticalSlashIndex, attention, torch_path, vertical_slash_attention

B, N, HQ, HKV, D, BS = 1, 200, 4, 2, 64, 64


def _index(seed: int, n: int = N) -> VerticalSlashIndex:
    gen = torch.Generator().manual_seed(seed)
    vertical = torch.randint(0, n, (B, HQ, 12), generator=gen)
    slash = torch.randint(0, -(-n // BS), (B, HQ, 2), generator=gen)
    return VerticalSlashIndex.build(vertical, slash, BS)


class Block(torch.nn.Module):
    """A fused q/k/v projection (GQA), the sparse attention over the given index (its pattern built in the graph, as
    the model's layers build theirs), an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(HQ * D, (HQ + 2 * HKV) * D, bias=False)
        self.proj = torch.nn.Linear(HQ * D, HQ * D, bias=False)

    def forward(self, x: torch.Tensor, index: VerticalSlashIndex) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (HQ + 2 * HKV, D)).split([HQ, HKV, HKV], dim=2)
        # check_index=False: the validation synchronises with the host (a graph break), as the model passes it
        pattern = AttentionPattern(q.shape[1], index)
        return self.proj(vertical_slash_attention(q, k, v, pattern, check_index=False).flatten(2))


def _run(block: torch.nn.Module, fn, x: torch.Tensor, index: VerticalSlashIndex) -> list[torch.Tensor]:
    """Output, input gradient and parameter gradients of one forward + backward of ``fn`` (``block`` or its
    compiled form)."""
    block.zero_grad()
    x = x.detach().requires_grad_()
    out = fn(x, index)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    return [out.detach(), x.grad, *(p.grad for p in block.parameters())]


def test_compiled_block_has_no_graph_break_and_matches_eager():
    """fullgraph=True compiles (Inductor, CPU); out and every gradient equal eager's (fp32). A new index of the same
    shapes, as every training step estimates one, reuses the graph."""
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(B, N, HQ * D)
    explanation = torch._dynamo.explain(block)(x, _index(0))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(block, fullgraph=True, backend=counter)
    for seed in (0, 1):
        index = _index(seed)
        want = _run(block, block, x, index)
        got = _run(block, compiled, x, index)
        for name, g, w in zip(("out", "dx", "dW qkv", "dW proj"), got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=name)
    assert counter.frame_count == 1


def _inputs(dtype: torch.dtype = torch.float32, n: int = N):
    gen = torch.Generator().manual_seed(2)
    q, do = (torch.randn(B, n, HQ, D, generator=gen, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, n, HKV, D, generator=gen, dtype=dtype) for _ in range(2))
    return q, k, v, do


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_torch_path_ops_pass_opcheck(dtype):
    """Schema, fake kernels (shapes, dtypes, strides; fp64 keeps an fp64 lse) and AOT dispatch of the PyTorch path's
    ops, on a partial last tile (their launchers' own layouts depend on N % bs)."""
    q, k, v, do = _inputs(dtype)
    index = _index(3)
    out, lse = torch_path.forward_op(q, k, v, index.vertical, index.slash, BS, 0.125)
    torch.library.opcheck(torch_path.forward_op, (q, k, v, index.vertical, index.slash, BS, 0.125))
    torch.library.opcheck(torch_path.backward_op, (do, q, k, v, out, lse, index.vertical, index.slash, BS, 0.125))


@pytest.fixture
def triton_backend(monkeypatch):
    """The Triton ops for CPU tensors (through the interpreter), as ``vertical_slash_attention`` picks them on CUDA."""
    triton_backend = pytest.importorskip("ds_mtraining.sparse.triton")
    monkeypatch.setattr(attention, "kernel_backend", lambda q: triton_backend)
    return triton_backend


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_triton_ops_pass_opcheck(triton_backend, layout):
    """The Triton ops' fake kernels give the launchers' layouts: out like ``empty_like(q)``; a gradient like its
    input where that is dense (``[B, H, N, D]`` storage seen as ``[B, N, H, D]``), else contiguous (a slice of a
    fused q/k/v)."""
    q, k, v, do = _inputs(n=128)
    if layout == "transposed":
        q, k, v, do = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, do))
    elif layout == "sliced":
        q, k, v = torch.cat([q, k, v], dim=2).split([HQ, HKV, HKV], dim=2)
    tensors = _index(4, n=128).kernel_index(128).tensors
    out, lse = triton_backend.forward_op(q, k, v, *tensors, BS, 0.125)
    torch.library.opcheck(triton_backend.forward_op, (q, k, v, *tensors, BS, 0.125))
    torch.library.opcheck(triton_backend.backward_op, (do, q, k, v, out, lse, *tensors, BS, 0.125))


def test_compiled_triton_attention_matches_eager(triton_backend):
    """fullgraph=True over the Triton ops (aot_eager: the interpreter runs the kernels): no graph break, the index's
    kernel form is built inside the graph and cached on the index, out, lse and gradients equal eager's."""
    q, k, v, do = _inputs(n=128)

    def attend(q, k, v, index):
        pattern = AttentionPattern(q.shape[1], index)
        return vertical_slash_attention(q, k, v, pattern, check_index=False, return_lse=True)

    def run(fn, index):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out, lse = fn(*leaves, index)
        return [out.detach(), lse, *torch.autograd.grad(out, leaves, do)]

    explanation = torch._dynamo.explain(attend)(q, k, v, _index(5, n=128))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    index = _index(6, n=128)
    got = run(torch.compile(attend, fullgraph=True, backend="aot_eager"), index)
    assert list(index._kernel_forms) == [index.num_blocks(128)]
    want = run(attend, index)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert torch.equal(g, w), name
