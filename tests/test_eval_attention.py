"""The evaluation attention on a tiny random Llama: dense matches SDPA, sparse settles to dense at full recall,
generation through the KV cache matches transformers' own greedy generation."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ds_mtraining.config import SparseAttentionConfig
from ds_mtraining.eval.attention import NAME, EvalAttention
from ds_mtraining.eval.generate import greedy_generate
from ds_mtraining.eval.perplexity import perplexity


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=128,
        vocab_size=64, max_position_embeddings=1024,
    )  # fmt: skip
    ours = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=NAME, dtype=torch.float64).eval()
    # _from_config sets the attention on the config object itself: give each model its own.
    ref = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=torch.float64).eval()
    ref.load_state_dict(ours.state_dict())
    return ours, ref


IDS = torch.randint(0, 64, (1, 256), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def test_dense_matches_sdpa(models):
    ours, ref = models
    torch.testing.assert_close(ours(IDS, eval_attention=EvalAttention()).logits, ref(IDS).logits)


@torch.no_grad()
def test_sparse_at_full_recall_is_dense_and_reports_stats(models):
    ours, ref = models
    full = SparseAttentionConfig(
        vertical_recall=1.0, slash_recall=1.0, vertical_max=4096, slash_max=4096, block_size=64
    )
    attention = EvalAttention(sparse=full)
    torch.testing.assert_close(ours(IDS, eval_attention=attention).logits, ref(IDS).logits)
    assert sorted(attention.stats) == [0, 1] and attention.mean_recall() == pytest.approx(1.0, abs=1e-6)
    masked = EvalAttention(
        sparse=SparseAttentionConfig(estimator="baseline", sink_tokens=0, vertical_max=8, slash_max=8), masked=True
    )
    kernel = EvalAttention(
        sparse=SparseAttentionConfig(estimator="baseline", sink_tokens=0, vertical_max=8, slash_max=8)
    )
    torch.testing.assert_close(ours(IDS, eval_attention=masked).logits, ours(IDS, eval_attention=kernel).logits)
    assert masked.mean_density() < 1.0


def test_greedy_generation_matches_transformers(models):
    ours, ref = models
    prompt = IDS[:, :40]
    expected = ref.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, 40:].tolist()
    assert greedy_generate(ours, prompt, EvalAttention(), 6) == expected


def test_perplexity_same_tokens_every_length(models):
    ours, _ = models
    results = perplexity(ours, IDS, [128, 256], {"dense": EvalAttention()})
    assert [r.tokens for r in results] == [254, 255]
    assert all(r.perplexity > 1 for r in results)


@torch.no_grad()
def test_padding_mask_is_refused_not_dropped(models):
    ours, ref = models
    mask = torch.ones_like(IDS)
    torch.testing.assert_close(
        ours(IDS, attention_mask=mask, eval_attention=EvalAttention()).logits, ref(IDS).logits
    )  # all ones: no padding, nothing to refuse
    mask[0, :5] = 0
    with pytest.raises(ValueError, match="takes no padding mask"):
        ours(IDS, attention_mask=mask, eval_attention=EvalAttention())
