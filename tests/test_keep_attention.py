"""Keep-attention activation checkpointing (``integration.recompute.keep_attention``): the recomputation takes
each sparse layer's (out, lse) from the forward instead of running the attention kernel, with the same loss
and gradients as plain checkpointing and as no checkpointing."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ds_mtraining.config import ConfigError, MTrainingConfig, SparseAttentionConfig, SpreadEstimator
from ds_mtraining.integration import recompute
from ds_mtraining.integration.model_loading import resolve_model
from ds_mtraining.integration.recompute import attend_once, enable_activation_checkpointing, keep_attention
from ds_mtraining.integration.transformers import MTrainingAttention
from ds_mtraining.sparse import AttentionPattern, VerticalSlashIndex, torch_path, vertical_slash_attention

VOCAB, N = 128, 384
# Layer 0 dense, layers 1-3 sparse: three kernel calls per forward.
SPARSE = SparseAttentionConfig(
    block_size=64,
    estimator=SpreadEstimator(rows=16, max_columns=8, max_offsets=2, recall=0.7),
    overrides=[{"layers": [0], "pattern": "dense"}],
)
SPARSE_LAYERS = 3
MODES = {
    "none": None,
    "plain": {"reuse": True},
    "keep": {"reuse": True, "keep_attention": True},
}


@pytest.fixture(scope="module")
def model():
    model = resolve_model("tiny-qwen2", vocab_size=VOCAB, max_positions=1024).build(seed=0).to(torch.float64)
    model.train()
    return model


@pytest.fixture
def kernel_calls(monkeypatch):
    """Shapes of q of every call of the PyTorch path's forward kernel."""
    calls = []
    real = torch_path.vertical_slash_forward

    def counting(q, *args, **kwargs):
        calls.append(tuple(q.shape))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(torch_path, "vertical_slash_forward", counting)
    return calls


def _ids(b=1, seed=1):
    return torch.randint(0, VOCAB, (b, N), generator=torch.Generator().manual_seed(seed))


def _set_mode(model, mode):
    if MODES[mode] is None:  # transformers 5 renamed gradient checkpointing to activation checkpointing
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()
    else:
        enable_activation_checkpointing(model, **MODES[mode])


def _loss(model, ids, attention):
    logits = model(ids, mtraining=attention).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _loss_and_grads(model, ids, mode, *, backwards=1):
    _set_mode(model, mode)
    model.zero_grad()
    attention = MTrainingAttention(SPARSE)
    loss = _loss(model, ids, attention)
    for i in range(backwards):
        loss.backward(retain_graph=i + 1 < backwards)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, attention


def _assert_same(got, want, tol):
    assert got.keys() == want.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], atol=tol, rtol=tol, msg=lambda m, name=name: f"{name}: {m}")


def test_same_loss_and_gradients_and_the_kernel_runs_once_per_sparse_layer(model, kernel_calls):
    ids = _ids(b=2)
    results, calls = {}, {}
    for mode in MODES:
        kernel_calls.clear()
        results[mode] = _loss_and_grads(model, ids, mode)
        calls[mode] = len(kernel_calls)
    # The kernel: once per sparse layer without checkpointing, twice with plain checkpointing (forward and
    # recomputation), once with the kept attention.
    assert calls == {"none": SPARSE_LAYERS, "plain": 2 * SPARSE_LAYERS, "keep": SPARSE_LAYERS}, calls
    loss, grads, attention = results["keep"]
    assert float(attention.stats[1].density) < 0.9  # really sparse indices: a wrong (out, lse) would show
    assert float(attention.stats[0].density) == 1.0
    for reference in ("plain", "none"):
        ref_loss, ref_grads, _ = results[reference]
        torch.testing.assert_close(loss, ref_loss, atol=1e-13, rtol=1e-13)
        _assert_same(grads, ref_grads, 1e-12)
    assert all(g.abs().max() > 0 for g in grads.values())  # every parameter gets a gradient here


def test_second_backward_recomputes_the_kernel(model, kernel_calls):
    """A second backward through the same graph finds the store empty: the recomputation runs the kernel again
    (from the same index and inputs), and the accumulated gradients match plain checkpointing's."""
    ids = _ids(seed=2)
    _, plain, _ = _loss_and_grads(model, ids, "plain", backwards=2)
    kernel_calls.clear()
    _, kept, _ = _loss_and_grads(model, ids, "keep", backwards=2)
    # forward + first recomputation (kept) + second recomputation (kernel)
    assert len(kernel_calls) == 2 * SPARSE_LAYERS, kernel_calls
    _assert_same(kept, plain, 1e-12)


@pytest.mark.parametrize("dtype,lse_bytes", [(torch.float64, 8), (torch.float32, 4)])
def test_bytes_kept_per_sparse_layer(monkeypatch, dtype, lse_bytes):
    """Between forward and backward each sparse layer's store holds its out and lse, ``B*N*Hq*D*itemsize +
    B*Hq*N*itemsize(lse)`` bytes, dense layers nothing; the backward empties the stores; no_grad keeps nothing."""
    model = resolve_model("tiny-qwen2", vocab_size=VOCAB, max_positions=1024).build(seed=0).to(dtype)
    model.train()
    stores: list[dict] = []

    def recording():
        forward, recomputation = keep_attention()

        @contextlib.contextmanager
        def recorded():
            with forward:
                stores.append(recompute._STORE.get().store)
                yield

        return recorded(), recomputation

    monkeypatch.setattr(recompute, "_keep_attention_context", recording)
    enable_activation_checkpointing(model, keep_attention=True)
    b, heads, dim = 2, model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    ids = _ids(b=b, seed=3)
    loss = _loss(model, ids, MTrainingAttention(SPARSE))
    assert len(stores) == model.config.num_hidden_layers  # one store per checkpointed layer call

    def kept(store):
        pairs = [v for k, v in store.items() if isinstance(k, recompute._AttentionKey)]
        return [sum(x.untyped_storage().nbytes() for x in pair) for pair in pairs]

    per_layer = [kept(store) for store in stores]
    expected = b * N * heads * dim * dtype.itemsize + b * heads * N * lse_bytes
    assert per_layer == [[]] + [[expected]] * SPARSE_LAYERS, (per_layer, expected)
    loss.backward()
    assert [kept(store) for store in stores] == [[]] * len(stores)  # popped by the recomputation
    stores.clear()
    with torch.no_grad():
        _loss(model, ids, MTrainingAttention(SPARSE))
    assert [kept(store) for store in stores] == [[]] * len(stores)


def test_precomputed_attention_skips_the_kernel_with_the_same_gradients(kernel_calls):
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 256, 4, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 256, 2, 16, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(2))
    vertical = torch.tensor([0, 3, 100], dtype=torch.long).expand(1, 4, 3).contiguous()
    slash = torch.tensor([0, 2], dtype=torch.long).expand(1, 4, 2).contiguous()
    pattern = AttentionPattern(256, VerticalSlashIndex(vertical, slash, 64))
    dout = torch.randn(1, 256, 4, 16, dtype=torch.float64, generator=gen)
    out, lse = vertical_slash_attention(q, k, v, pattern, return_lse=True)
    want = torch.autograd.grad(out, (q, k, v), dout)
    assert len(kernel_calls) == 1
    kept = (out.detach(), lse.detach())
    again, again_lse = vertical_slash_attention(q, k, v, pattern, return_lse=True, precomputed=kept)
    assert len(kernel_calls) == 1  # no kernel
    assert again is not kept[0] and again.data_ptr() == out.data_ptr() and torch.equal(again_lse, lse)
    assert kept[0].grad_fn is None  # the kept tensors are not made part of this call's graph
    got = torch.autograd.grad(again, (q, k, v), dout)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    with pytest.raises(ValueError, match="needs a pattern with an index"):
        vertical_slash_attention(q, k, v, None, precomputed=kept)
    with pytest.raises(ValueError, match="needs a pattern with an index"):
        vertical_slash_attention(q, k, v, AttentionPattern(256), precomputed=kept)
    with pytest.raises(ValueError, match=r"precomputed \(out, lse\) must be"):
        vertical_slash_attention(q, k, v, pattern, precomputed=(kept[0][:, :128], kept[1]))


def test_attend_once_outside_a_checkpoint_runs_the_attention():
    seen = []

    def attend(kept):
        seen.append(kept)
        return torch.zeros(1), torch.zeros(1)

    attend_once(0, attend)
    forward, recomputation = keep_attention()
    with forward, torch.no_grad():
        attend_once(0, attend)  # no autograd: nothing kept
    with recomputation:
        attend_once(0, attend)  # so the recomputation runs it
    assert seen == [None, None, None]


def test_keep_attention_needs_reuse(model):
    with pytest.raises(ValueError, match="keep_attention=True needs reuse=True"):
        enable_activation_checkpointing(model, reuse=False, keep_attention=True)


def test_config_option():
    """``"auto"`` by default (decided by the start-up memory estimate, ``tests/test_memory_plan.py``); a value the
    launchers cannot take is refused, where the job decides ``"auto"`` and where a loop of one's own passes it."""
    assert MTrainingConfig().activation_checkpointing.keep_attention == "auto"
    on = MTrainingConfig.from_deepspeed_config({"mtraining": {"activation_checkpointing": {"keep_attention": True}}})
    assert on.activation_checkpointing.keep_attention is True
    bad = r"mtraining\.activation_checkpointing\.keep_attention = 'yes': .*true, false or"
    with pytest.raises(ConfigError, match=bad):
        MTrainingConfig.from_deepspeed_config({"mtraining": {"activation_checkpointing": {"keep_attention": "yes"}}})
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.keep: unknown key; allowed keys: keep_attention"):
        MTrainingConfig.from_deepspeed_config({"mtraining": {"activation_checkpointing": {"keep": True}}})
    with pytest.raises(ValueError, match=r"keep_attention must be True or False; got 'auto' \(the training job"):
        enable_activation_checkpointing(torch.nn.Module(), keep_attention="auto")


def _ulysses_worker(rank: int, world: int) -> None:
    """Ulysses (U=2, R=1): the gathered sequence runs ``vertical_slash_attention`` too, so the kept attention
    applies; on each rank the loss and gradients equal plain checkpointing's, with half the kernel calls."""
    from ds_mtraining.integration.batch import make_batch, sequence_loss
    from ds_mtraining.parallel.mesh import Mesh, MeshShape

    calls = []
    real = torch_path.vertical_slash_forward

    def counting(q, *args, **kwargs):
        calls.append(tuple(q.shape))
        return real(q, *args, **kwargs)

    torch_path.vertical_slash_forward = counting  # this process only
    model = resolve_model("tiny-qwen2", vocab_size=VOCAB, max_positions=1024).build(seed=0).to(torch.float64)
    model.train()
    shape = MeshShape.build(world=world, ulysses=2, ring=1, q_heads=4, kv_heads=2)
    mesh = Mesh(shape)
    layout = shape.layout(N, kind="striped", block_size=64, stripe=None)
    batch = make_batch(_ids(seed=5), mesh=mesh, layout=layout, pad_id=0)
    results = {}
    for mode in ("plain", "keep"):
        _set_mode(model, mode)
        model.zero_grad()
        calls.clear()
        attention = MTrainingAttention(SPARSE, mesh=mesh, layout=layout)
        logits = model(batch.input_ids, position_ids=batch.position_ids, mtraining=attention).logits
        loss = sequence_loss(logits, batch.labels, batch.label_tokens)
        loss.backward()
        results[mode] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls)
    assert results["plain"][2] == 2 * SPARSE_LAYERS and results["keep"][2] == SPARSE_LAYERS, (rank, results)
    torch.testing.assert_close(results["keep"][0], results["plain"][0], atol=1e-13, rtol=1e-13)
    _assert_same(results["keep"][1], results["plain"][1], 1e-12)


def test_ulysses_keeps_the_attention_too():
    from distributed import run_distributed

    run_distributed(2, _ulysses_worker, timeout=240)
