"""Dense causal attention's kernels on a GPU (``sparse.dense``): every kernel installed, the project's choice among
them, against the float64 definition in bf16, out and dq / dk / dv; and the choice being the table's."""

from __future__ import annotations

import pytest
import torch

from benchmarks import dense_kernels
from ds_mtraining.sparse import dense

cuda = pytest.mark.cuda


def _args(**shape):
    return type("Args", (), {"device": "cuda", "check_seqlen": 1000, "seed": 3, **shape})


@cuda
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(16, 2, 128), (4, 4, 64), (6, 2, 128)])
@pytest.mark.parametrize("name", list(dense_kernels.kernels("cuda")))
def test_every_dense_kernel_matches_float64_in_bf16(name, heads, kv_heads, head_dim):
    args = _args(heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    errs = dense_kernels.errors(dense_kernels.kernels("cuda")[name], args, torch.bfloat16)
    assert max(errs) <= dense_kernels.TOLERANCE[torch.bfloat16], errs


@cuda
def test_the_choice_follows_the_table():
    device = torch.device("cuda")
    major, _ = torch.cuda.get_device_capability()
    installed = dense._flash_attn_4() is not None
    expected = "flash_attn_4" if installed and "flash_attn_4" in dense.DENSE_ORDER.get(major, ()) else "sdpa"
    assert dense.dense_kernel(device, torch.bfloat16, 128) == expected
    assert dense.dense_kernel(device, torch.float32, 128) == "sdpa"  # flash-attn-4 takes no fp32
    assert dense.dense_kernel(device, torch.bfloat16, 100) == "sdpa"  # nor rows of 200 bytes


@cuda
def test_torch_compile_traces_the_dense_path_whole():
    """flash-attn-4 registers no custom op: under torch.compile the choice is SDPA, so a whole graph traces."""
    gen = torch.Generator(device="cpu").manual_seed(5)
    q, k, v = (torch.randn(1, 256, h, 128, generator=gen).cuda().bfloat16() for h in (4, 2, 2))
    compiled = torch.compile(dense.dense_causal_attention, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v, 0.1), dense.dense_causal_attention(q, k, v, 0.1), atol=2e-2, rtol=0)
