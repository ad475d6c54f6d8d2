"""The evaluations' use of the one attention handle (``MTrainingAttention``) on a tiny random Llama: dense matches
SDPA, sparse settles to dense at full recall, generation through the KV cache matches transformers' own greedy
generation (dense, and after a sparse prefill), probes see whole sequences only."""

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ds_mtraining.config import BaselineEstimator, SparseAttentionConfig, SpreadEstimator
from ds_mtraining.eval.generate import greedy_generate
from ds_mtraining.eval.perplexity import perplexity
from ds_mtraining.integration.transformers import NAME, MTrainingAttention
from ds_mtraining.sparse.dense import dense_causal_attention

DENSE = SparseAttentionConfig(pattern="dense")
# The default strategy (spread) with caps past the sequence; the flat vertical_recall / slash_recall = 1.0 this
# once set were the baseline's, ignored by spread, and are not spread's settings.
FULL = SparseAttentionConfig(estimator=SpreadEstimator(max_columns=4096, max_offsets=4096), block_size=64)
SMALL = SparseAttentionConfig(estimator=BaselineEstimator(max_columns=8, max_diagonals=8), sink_tokens=0)


def handle(sparse: SparseAttentionConfig = DENSE, **kwargs) -> MTrainingAttention:
    """An evaluation's handle (``launch/eval.py``'s settings)."""
    return MTrainingAttention(sparse, **kwargs)


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
    torch.testing.assert_close(ours(IDS, mtraining=handle()).logits, ref(IDS).logits)


@torch.no_grad()
def test_sparse_at_full_recall_is_dense_and_reports_stats(models):
    ours, ref = models
    attention = handle(FULL)
    torch.testing.assert_close(ours(IDS, mtraining=attention).logits, ref(IDS).logits)
    assert sorted(attention.stats) == [0, 1] and attention.mean_recall() == pytest.approx(1.0, abs=1e-6)
    masked, kernel = handle(SMALL, masked=True), handle(SMALL)
    torch.testing.assert_close(ours(IDS, mtraining=masked).logits, ours(IDS, mtraining=kernel).logits)
    assert masked.mean_density() < 1.0


@pytest.mark.parametrize("sparse", [DENSE, FULL], ids=["dense", "sparse-prefill"])
def test_greedy_generation_matches_transformers(models, sparse):
    ours, ref = models
    prompt = IDS[:, :200]
    expected = ref.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, 200:].tolist()
    attention = handle(sparse)
    assert greedy_generate(ours, prompt, attention, 6) == expected
    assert sorted(attention.stats) == [0, 1]  # the prefill's; the decoding steps record nothing


@torch.no_grad()
def test_decoding_rows_attend_to_the_cache_causally():
    """New rows after a cache (one, or a chunk) attend as the last rows of the whole sequence do."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 70, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    full = dense_causal_attention(q, k, v, 0.25)
    for rows in (1, 5):
        torch.testing.assert_close(dense_causal_attention(q[:, -rows:], k, v, 0.25), full[:, -rows:])
        # a sparse layer's decoding step is dense over the cache too, and leaves the prefill's statistics alone
        attention = handle(SMALL)
        torch.testing.assert_close(attention.attend(0, q[:, -rows:], k, v, 0.25), full[:, -rows:])
        assert attention.stats == {}


def test_probe_sees_the_prefill_only(models):
    ours, _ = models
    seen = []
    attention = handle(probe=lambda layer, q, k, v, scale: seen.append((layer, q.shape[1], k.shape[1])))
    greedy_generate(ours, IDS[:, :40], attention, 3)
    assert seen == [(0, 40, 40), (1, 40, 40)]


def test_whole_sequence_settings_are_refused_on_a_sharded_sequence():
    sharded = SimpleNamespace(sp_size=2)  # what attend reads before it refuses
    q = torch.zeros(1, 8, 2, 4)
    for kwargs in ({"masked": True}, {"probe": lambda *a: None}):
        with pytest.raises(ValueError, match="need the whole sequence on one rank"):
            MTrainingAttention(SMALL, mesh=sharded, **kwargs).attend(0, q, q, q, 0.5)
    with pytest.raises(ValueError, match="need the whole sequence on one rank"):
        MTrainingAttention(SMALL, mesh=sharded).attend(0, q[:, -1:], q, q, 0.5)


def test_perplexity_same_tokens_every_length(models):
    ours, _ = models
    results = perplexity(ours, IDS, [128, 256], {"dense": handle()})
    assert [r.tokens for r in results] == [254, 255]
    assert all(r.perplexity > 1 for r in results)


def test_perplexity_runs_longest_windows_first_each_under_every_attention(models):
    """The order that keeps an extrapolated ETA honest (``launch/eval.py perplexity``'s progress in tokens), with the
    results of each attention as it alone would give them, in the order asked for."""
    ours, _ = models
    attentions = {"dense": handle(), "sparse": handle(SMALL)}
    tokens: list[int] = []
    results = perplexity(ours, IDS, [128, 256], attentions, advance=tokens.append)
    assert [(r.length, r.attention) for r in results] == [(128, "dense"), (128, "sparse"), (256, "dense"), (256, "sparse")]
    assert tokens == [256, 256] + [128, 128] * 2  # one 256-token window, then two of 128, each under both
    alone = perplexity(ours, IDS, [128, 256], {"sparse": handle(SMALL)})
    assert [r.perplexity for r in results[1::2]] == pytest.approx([r.perplexity for r in alone], rel=1e-9)


@torch.no_grad()
def test_padding_mask_is_refused_not_dropped(models):
    ours, ref = models
    mask = torch.ones_like(IDS)
    torch.testing.assert_close(
        ours(IDS, attention_mask=mask, mtraining=handle()).logits, ref(IDS).logits
    )  # all ones: no padding, nothing to refuse
    mask[0, :5] = 0
    with pytest.raises(ValueError, match="takes no attention_mask"):
        ours(IDS, attention_mask=mask, mtraining=handle())


def test_fidelity_measures_only_the_layers_asked_for(models):
    """``measure_fidelity(layers=...)`` (``launch/eval.py fidelity --layers``): records of those layers' heads only,
    the same records as a run over every layer, and ``advance`` still once per layer."""
    from ds_mtraining.eval.fidelity import measure_fidelity

    ours, _ = models
    sparse = SparseAttentionConfig(block_size=64)
    calls = []
    every, _ = measure_fidelity(ours, IDS, sparse, last_rows=64)
    one, _ = measure_fidelity(ours, IDS, sparse, last_rows=64, layers=[1], advance=lambda: calls.append(1))
    assert len(calls) == 2 and {r.layer for r in one} == {1} and len(one) == 4
    assert one == [r for r in every if r.layer == 1]


def test_fidelity_records_do_not_depend_on_the_oracle_head_groups(models, monkeypatch):
    """All four heads of a layer in one oracle batch (the default at this size) or one head a batch (the bound
    a long sequence meets): the same records."""
    from ds_mtraining.eval import fidelity

    ours, _ = models
    sparse = SparseAttentionConfig(block_size=64)
    together, _ = fidelity.measure_fidelity(ours, IDS, sparse, last_rows=64)
    monkeypatch.setattr(fidelity, "ORACLE_BYTES", 1)
    alone, _ = fidelity.measure_fidelity(ours, IDS, sparse, last_rows=64)
    assert together == alone and len(together) == 8
