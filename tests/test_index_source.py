"""``MTrainingAttention(indices=...)``: planted indices and no attention, the benchmark's modes, against float64
references built from the index semantics."""

from __future__ import annotations

import pytest
import torch

from ds_mtraining.config import SparseAttentionConfig
from ds_mtraining.integration.transformers import MTrainingAttention, PlantedIndices
from ds_mtraining.sparse import index_to_dense_mask
from ds_mtraining.sparse.planted import planted_index

B, N, HQ, HKV, D, BS = 2, 512, 4, 2, 16, 64
SPARSE = SparseAttentionConfig(block_size=BS, overrides=[{"layers": [0], "pattern": "dense"}])


def _qkv(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, N, h, D, generator=gen, dtype=torch.float64) for h in (HQ, HKV, HKV))


def _reference(q, k, v, mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention under ``mask`` ([B, Hq, N, N]), float64, GQA by repeating K/V."""
    k, v = (x.repeat_interleave(HQ // HKV, dim=2) for x in (k, v))
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * D**-0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("bhij,bjhd->bihd", probs, v)


@pytest.mark.parametrize("run_estimator", [False, True])
def test_planted_indices_attend_over_the_planted_index(run_estimator):
    q, k, v = _qkv(1)
    attention = MTrainingAttention(SPARSE, indices=PlantedIndices(0.3, run_estimator=run_estimator, seed=5))
    out = attention.attend(1, q, k, v, D**-0.5)
    index = planted_index(B, HQ, N, BS, density=0.3, columns=N // 16, local_tokens=N // 8,
                          generator=torch.Generator().manual_seed(5))  # fmt: skip
    assert 0.3 <= float(index.density(N).mean()) < 0.45  # sparse: the test would see a wrong tile
    torch.testing.assert_close(out, _reference(q, k, v, index_to_dense_mask(index, N)), rtol=1e-10, atol=1e-10)
    assert float(attention.stats[1].density) == pytest.approx(float(index.density(N).mean()))
    assert float(attention.stats[1].recall) == 1.0  # nothing observed
    dense = attention.attend(0, q, k, v, D**-0.5)  # a dense layer stays dense
    causal = torch.ones(N, N, dtype=torch.bool).tril().expand(B, HQ, N, N)
    torch.testing.assert_close(dense, _reference(q, k, v, causal), rtol=1e-10, atol=1e-10)


def test_planted_index_is_one_per_shape_and_seed():
    q, k, v = _qkv(2)
    attention = MTrainingAttention(SPARSE, indices=PlantedIndices(0.3, run_estimator=False))
    first = attention.attend(1, q, k, v, D**-0.5)
    again = attention.attend(2, *_qkv(2), D**-0.5)
    torch.testing.assert_close(first, again, rtol=0, atol=0)  # the same index in every layer
    other = MTrainingAttention(SPARSE, indices=PlantedIndices(0.3, run_estimator=False, seed=1))
    assert not torch.equal(other.attend(1, q, k, v, D**-0.5), first)


def test_no_attention_returns_each_heads_values_in_every_layer():
    q, k, v = _qkv(3)
    attention = MTrainingAttention(SPARSE, indices="none")
    for layer in (0, 1):  # the dense layer too: the ceiling of the step without any attention
        out = attention.attend(layer, q, k, v, D**-0.5)
        torch.testing.assert_close(out, v.repeat_interleave(HQ // HKV, dim=2), rtol=0, atol=0)
        assert float(attention.stats[layer].density) == 1.0
