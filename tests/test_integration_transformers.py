"""attn_implementation="mtraining" in tiny Qwen2 / Llama models against transformers' own SDPA attention."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from ds_mtraining.config import BaselineEstimator, SparseAttentionConfig, SpreadEstimator
from ds_mtraining.integration.transformers import MTrainingAttention
from ds_mtraining.sparse import VerticalSlashIndex

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    use_cache=False,
)
MODELS = [
    pytest.param(Qwen2ForCausalLM, Qwen2Config, id="qwen2"),
    pytest.param(LlamaForCausalLM, LlamaConfig, id="llama"),
]
EVERYTHING = SparseAttentionConfig(
    estimator=BaselineEstimator(column_recall=1.0, diagonal_recall=1.0, max_columns=4096, max_diagonals=4096)
)


def sdpa_and_ours(model_cls, config):
    """The same random float64 weights with SDPA and with our attention (configs copied: HF writes into them)."""
    torch.manual_seed(0)
    reference = model_cls._from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=torch.float64)
    ours = model_cls._from_config(copy.deepcopy(config), attn_implementation="mtraining", dtype=torch.float64)
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def _run(model, ids, **kwargs):
    model.zero_grad()
    logits = model(ids, **kwargs).logits
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("model_cls,config_cls", MODELS)
@pytest.mark.parametrize(
    "sparse,tol",
    [
        pytest.param(SparseAttentionConfig(pattern="dense"), 1e-12, id="dense"),
        pytest.param(EVERYTHING, 1e-10, id="sparse-covering-everything"),
    ],
)
def test_matches_sdpa(model_cls, config_cls, sparse, tol):
    reference, ours = sdpa_and_ours(model_cls, config_cls(**TINY))
    ids = torch.randint(0, TINY["vocab_size"], (2, 200), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads = _run(reference, ids)
    attention = MTrainingAttention(sparse)
    logits, grads = _run(ours, ids, mtraining=attention)
    torch.testing.assert_close(logits, ref_logits, atol=tol, rtol=tol)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")
    assert sorted(attention.stats) == [0, 1]
    for stats in attention.stats.values():
        assert float(stats.density) == pytest.approx(1.0) and float(stats.recall) == pytest.approx(1.0)


def test_sparse_layers_and_dense_override():
    _, ours = sdpa_and_ours(Qwen2ForCausalLM, Qwen2Config(**TINY))
    ids = torch.randint(0, TINY["vocab_size"], (1, 1024), generator=torch.Generator().manual_seed(2))
    sparse = SparseAttentionConfig(
        estimator=BaselineEstimator(column_recall=0.5, diagonal_recall=0.5, max_columns=8, max_diagonals=1),
        sink_tokens=4,
        overrides=[{"layers": [0], "pattern": "dense"}],
    )
    attention = MTrainingAttention(sparse)
    ours(ids, mtraining=attention)
    assert float(attention.stats[0].density) == 1.0
    assert float(attention.stats[1].density) < 0.6


def test_needs_handle_and_rejects_padding_masks():
    _, ours = sdpa_and_ours(Qwen2ForCausalLM, Qwen2Config(**TINY))
    ids = torch.randint(0, TINY["vocab_size"], (1, 64))
    with pytest.raises(ValueError, match="mtraining=MTrainingAttention"):
        ours(ids)
    mask = torch.ones(1, 64, dtype=torch.long)
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="takes no attention_mask"):
        ours(ids, attention_mask=mask, mtraining=MTrainingAttention(EVERYTHING))
    ours(
        ids, attention_mask=torch.ones(1, 64, dtype=torch.long), mtraining=MTrainingAttention(EVERYTHING)
    )  # all ones: fine


def test_checkpoint_recomputation_reuses_the_index(monkeypatch):
    """With activation checkpointing and ``context_fn=reuse_index`` (the default), each sparse layer estimates its index once per
    forward + backward (not again in the recomputation), and the gradients equal those without checkpointing."""
    from ds_mtraining.parallel import context
    from ds_mtraining.integration.recompute import enable_activation_checkpointing

    calls = []
    real = context.estimate_index

    def counting(q, k, config, **kwargs):
        calls.append(tuple(q.shape))
        return real(q, k, config, **kwargs)

    monkeypatch.setattr(context, "estimate_index", counting)
    _, ours = sdpa_and_ours(Qwen2ForCausalLM, Qwen2Config(**TINY))
    ids = torch.randint(0, TINY["vocab_size"], (1, 512), generator=torch.Generator().manual_seed(3))
    sparse = SparseAttentionConfig(
        block_size=64, estimator=SpreadEstimator(rows=16, max_columns=8, max_offsets=2, recall=0.7)
    )
    ours.train()
    plain_logits, plain_grads = _run(ours, ids, mtraining=MTrainingAttention(sparse))
    assert len(calls) == 2  # two sparse layers, no recomputation
    enable_activation_checkpointing(ours)
    calls.clear()
    attention = MTrainingAttention(sparse)
    logits, grads = _run(ours, ids, mtraining=attention)
    assert len(calls) == 2, calls  # the recomputation took the forward's indices
    assert float(attention.stats[1].density) < 0.9  # the indices are sparse: reusing the wrong one would show
    torch.testing.assert_close(logits, plain_logits, atol=0, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], atol=1e-12, rtol=1e-12, msg=lambda m: f"{name}: {m}")
    # Without the context, the recomputation estimates again: what the reuse saves.
    enable_activation_checkpointing(ours, reuse=False)
    calls.clear()
    _run(ours, ids, mtraining=MTrainingAttention(sparse))
    assert len(calls) == 4


def test_model_forward_does_not_validate_the_estimated_index(monkeypatch):
    """The integration passes ``check_index=False``: the estimators' indices are valid by construction, and the
    validation's host syncs would stall every layer's launches on a GPU."""
    _, ours = sdpa_and_ours(Qwen2ForCausalLM, Qwen2Config(**TINY))

    def validate(self, seqlen):
        raise AssertionError("validate() called in the model's forward")

    monkeypatch.setattr(VerticalSlashIndex, "validate", validate)
    ids = torch.randint(0, TINY["vocab_size"], (1, 300), generator=torch.Generator().manual_seed(3))
    logits, _ = _run(ours, ids, mtraining=MTrainingAttention(EVERYTHING))
    assert torch.isfinite(logits).all()
