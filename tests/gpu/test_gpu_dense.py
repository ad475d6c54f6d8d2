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
