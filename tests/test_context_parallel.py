"""``parallel.context``: the mesh picks one strategy, and the whole-sequence strategy under Ulysses attends only the
real tokens of the padded gathered sequence. (The strategies' collectives run in the gloo tests of
``test_train_parallel.py`` and ``test_packed_documents.py``, through the attention handle.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ds_mtraining.config import SparseAttentionConfig, SpreadEstimator
from ds_mtraining.estimator import GraphCache
from ds_mtraining.parallel.context import Ring, Ulysses, WholeSequence, context_parallel
from ds_mtraining.parallel.layout import make_layout
from ds_mtraining.sparse import AttentionPattern, vertical_slash_attention_naive


def _mesh(ring: int, ulysses: int, inner: int | None = None, kv_exchange: str = "ring") -> SimpleNamespace:
    """What ``context_parallel`` reads of a ``Mesh``: the degrees and the groups (stand-ins: no collective runs)."""
    shape = SimpleNamespace(inner_ring=inner or ring, kv_exchange=kv_exchange)
    return SimpleNamespace(sp_size=ring * ulysses, ring_size=ring, ulysses_size=ulysses, ring=object(),
                           ulysses=object(), shape=shape)  # fmt: skip


def test_the_mesh_picks_one_strategy():
    layout = make_layout("striped", 2, 256, block_size=64)
    assert isinstance(context_parallel(None, None), WholeSequence)
    assert isinstance(context_parallel(_mesh(1, 1), None), WholeSequence)  # data parallelism only
    mesh = _mesh(4, 1, inner=2)
    ring = context_parallel(mesh, layout, columns="gathered")
    assert isinstance(ring, Ring) and ring.groups is mesh.ring and ring.layout is layout
    assert (ring.columns, ring.inner, ring.kv_exchange) == ("gathered", 2, "ring")
    assert context_parallel(_mesh(4, 1, inner=2, kv_exchange="all_gather"), layout).kv_exchange == "all_gather"
    mesh = _mesh(1, 2)
    ulysses = context_parallel(mesh, layout)
    assert isinstance(ulysses, Ulysses) and ulysses.group is mesh.ulysses
    assert isinstance(ulysses.inner, WholeSequence) and ulysses.inner.seqlen == layout.seqlen
    mesh = _mesh(2, 2)
    hybrid = context_parallel(mesh, layout)
    assert isinstance(hybrid, Ulysses) and isinstance(hybrid.inner, Ring) and hybrid.inner.groups is mesh.ring
    with pytest.raises(ValueError, match="needs the batches' layout"):
        context_parallel(_mesh(2, 1), None)


def test_whole_sequence_attends_only_the_real_tokens_of_a_padded_sequence():
    """Under Ulysses without a ring the gathered sequence is the layout's padded one: the estimate and the attention
    see the ``seqlen`` real tokens, the padding rows come back as zeros."""
    gen = torch.Generator().manual_seed(5)
    n, padded = 200, 256
    q, k, v = (torch.randn(1, padded, h, 16, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    config = SparseAttentionConfig(block_size=64, estimator=SpreadEstimator(rows=16, max_columns=8, max_offsets=2))
    strategy = WholeSequence(seqlen=n)
    pattern, report = strategy.estimate(q, k, config, AttentionPattern(n), scale=0.25, layer=1, graphs=GraphCache())
    assert pattern.seqlen == n and pattern.documents is None
    assert pattern.index.num_blocks(n) == 4 and report.density.shape == (1, 4)
    out = strategy.attend(q, k, v, pattern, scale=0.25, layer=1)
    assert out.shape == q.shape and not out[:, n:].any()
    expected = vertical_slash_attention_naive(q[:, :n], k[:, :n], v[:, :n], pattern, softmax_scale=0.25)
    torch.testing.assert_close(out[:, :n], expected, rtol=1e-10, atol=1e-10)
    assert strategy.work(pattern) is None
