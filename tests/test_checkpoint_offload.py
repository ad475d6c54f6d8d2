"""Activation checkpointing from the JSON: which layers checkpoint (``mtraining.activation_checkpointing.layers``),
checkpoints in CPU memory (DeepSpeed's ``cpu_checkpointing``, ``integration.checkpoint_offload``), and DeepSpeed's
keys that cannot apply refused in one line."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch

from ds_mtraining.config import ConfigError, MTrainingConfig, SparseAttentionConfig, SpreadEstimator
from ds_mtraining.integration.batch import Batch
from ds_mtraining.integration.checkpoint_offload import CheckpointOffload, _Saved
from ds_mtraining.integration.deepspeed import deepspeed_config
from ds_mtraining.integration.ds_config import check_ds_config, cpu_checkpointing
from ds_mtraining.integration.loss import forward_loss
from ds_mtraining.integration.model_loading import resolve_model
from ds_mtraining.integration.recompute import enable_activation_checkpointing
from ds_mtraining.integration.transformers import MTrainingAttention
from ds_mtraining.training import describe, plan
from ds_mtraining.training.cli import parse_args

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "ds_configs" / "zero2_offload.json"
VOCAB, N, B, LAYERS = 128, 384, 2, 4
SPARSE = SparseAttentionConfig(
    block_size=64,
    estimator=SpreadEstimator(rows=16, max_columns=8, max_offsets=2, recall=0.7),
    overrides=[{"layers": [0], "pattern": "dense"}],
)


@pytest.fixture(scope="module")
def model():
    model = resolve_model("tiny-qwen2", vocab_size=VOCAB, max_positions=1024).build(seed=0).to(torch.float64)
    model.train()
    return model


def _ids(seed=1):
    return torch.randint(0, VOCAB, (B, N), generator=torch.Generator().manual_seed(seed))


def _loss_and_grads(model, ids, *, every=1, offload=None, backwards=1):
    """Loss and every parameter's gradient with checkpointing on every ``every``-th layer (None: none)."""
    if every is None:
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()
    else:
        assert enable_activation_checkpointing(model, every=every, offload=offload) == -(-LAYERS // every)
    model.zero_grad()
    logits = model(ids, mtraining=MTrainingAttention(SPARSE)).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    for i in range(backwards):
        loss.backward(retain_graph=i + 1 < backwards)
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_checkpoints_in_cpu_memory_give_exactly_the_gradients_kept_on_the_device(model):
    """Offloaded or not, on every layer or every other one: the same loss and gradients, bit for bit where the
    checkpointed layers are the same, and within float64 rounding of no checkpointing at all."""
    ids = _ids()
    none = _loss_and_grads(model, ids, every=None)
    for every in (1, 2):
        kept = _loss_and_grads(model, ids, every=every)
        moved = _loss_and_grads(model, ids, every=every, offload=CheckpointOffload("cpu"))
        assert torch.equal(moved[0], kept[0])
        assert all(torch.equal(moved[1][name], grad) for name, grad in kept[1].items())
        torch.testing.assert_close(kept[0], none[0], atol=1e-13, rtol=1e-13)
        for name, grad in none[1].items():
            torch.testing.assert_close(kept[1][name], grad, atol=1e-12, rtol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    assert all(g.abs().max() > 0 for g in none[1].values())


def test_only_the_hidden_states_move_and_each_comes_back_once_ahead_of_its_layer(model, monkeypatch):
    """Each checkpointed layer's input (the hidden states; not the rotary tables every layer shares) goes to host
    memory in the forward; the backward fetches them last layer first, each once: the first when its layer's
    recomputation asks, every other one as the layer after it asks (the prefetch). The host buffers return to a pool
    that the next step reuses."""
    offload = CheckpointOffload("cpu")
    packed, fetched, asked = [], [], []
    pack, fetch, unpack = CheckpointOffload._pack, CheckpointOffload._fetch, CheckpointOffload._unpack

    def recording_pack(self, x):
        saved = pack(self, x)
        if isinstance(saved, _Saved):
            packed.append(saved)
        return saved

    def recording_fetch(self, saved):
        fetched.append((packed.index(saved), len(asked)))
        fetch(self, saved)

    def recording_unpack(self, saved):
        if isinstance(saved, _Saved):
            asked.append(packed.index(saved))
        return unpack(self, saved)

    monkeypatch.setattr(CheckpointOffload, "_pack", recording_pack)
    monkeypatch.setattr(CheckpointOffload, "_fetch", recording_fetch)
    monkeypatch.setattr(CheckpointOffload, "_unpack", recording_unpack)
    hidden = model.config.hidden_size
    buffers = []
    for step in range(2):
        packed.clear(), fetched.clear(), asked.clear()
        _loss_and_grads(model, _ids(seed=step), offload=offload)
        assert [tuple(s.shape) for s in packed] == [(B, N, hidden)] * LAYERS
        # B x N = 768 rows, in two pinned pieces (512 + 256 rows: memory.pinned_pieces), none rounded up.
        assert [[t.numel() for t in s.host] for s in packed] == [[512 * hidden, 256 * hidden]] * LAYERS
        assert asked == [3, 2, 1, 0]
        # (layer, recomputations asked so far, the asking one included): layer 3 is fetched when it asks, each
        # earlier layer when the layer after it asks, before its own ask.
        assert fetched == [(3, 1), (2, 1), (1, 2), (0, 3)]
        buffers.append({t.data_ptr() for s in packed for t in s.host})
        packed.clear()
        assert offload.host_bytes() == LAYERS * B * N * hidden * 8  # every buffer back in the pool
    assert buffers[0] == buffers[1]


def test_the_jobs_forward_frees_each_offloaded_checkpoint_before_the_next_layer_ends(model):
    """The job's forward (``forward_loss``: the loss in tiles from the final hidden states) under checkpoint offload:
    when the last decoder layer has run, no earlier layer's output is alive but the last layer's input (each was a
    checkpoint, now on the host). transformers 5.17 kept them all when asked for ``output_hidden_states``, and
    ``cpu_checkpointing`` then saved nothing on the GPU. The gradients are those of the checkpoints kept in place."""
    ids = _ids(seed=4)
    batch = Batch(ids, ids, torch.arange(N).expand(B, N), B * N)
    outputs: list[weakref.ref] = []
    alive: list[bool] = []

    def watch(module, _args, out):
        outputs.append(weakref.ref(out if isinstance(out, torch.Tensor) else out[0]))
        if module is model.model.layers[-1]:
            gc.collect()
            alive.extend(ref() is not None for ref in outputs)

    grads = []
    for offload in (None, CheckpointOffload("cpu")):
        enable_activation_checkpointing(model, offload=offload)
        handles = [layer.register_forward_hook(watch) for layer in model.model.layers]
        outputs.clear(), alive.clear()
        model.zero_grad()
        try:
            forward_loss(model, batch, MTrainingAttention(SPARSE)).backward()
        finally:
            for handle in handles:
                handle.remove()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    assert alive == [False] * (LAYERS - 2) + [True, True]
    assert all(torch.equal(grads[1][name], grad) for name, grad in grads[0].items())


def test_a_second_backward_fetches_the_checkpoints_again(model):
    ids = _ids(seed=3)
    kept = _loss_and_grads(model, ids, backwards=2)
    moved = _loss_and_grads(model, ids, offload=CheckpointOffload("cpu"), backwards=2)
    assert all(torch.equal(moved[1][name], grad) for name, grad in kept[1].items())


def test_every_k_must_be_positive(model):
    with pytest.raises(ValueError, match="every must be >= 1"):
        enable_activation_checkpointing(model, every=0)


@pytest.mark.parametrize(
    "section,needles",
    [
        ({"partition_activations": True}, ["activation_checkpointing.partition_activations", "model-parallel",
                                           "cpu_checkpointing"]),
        ({"contiguous_memory_optimization": True}, ["contiguous_memory_optimization", "remove it"]),
        ({"number_checkpoints": 8}, ["number_checkpoints: is 8", '"layers"']),
        ({"synchronize_checkpoint_boundary": True}, ["synchronize_checkpoint_boundary", "remove it"]),
        ({"profile": True}, ["activation_checkpointing.profile", "remove it"]),
        ({"cpu_checkpoint": True}, ["not a key DeepSpeed knows", "did you mean 'cpu_checkpointing'"]),
        ({"cpu_checkpointing": "yes"}, ["must be true or false, got 'yes'"]),
        ([True], ["activation_checkpointing: must be an object"]),
    ],
)  # fmt: skip
def test_deepspeed_keys_that_cannot_apply_are_refused_in_one_line(section, needles):
    with pytest.raises(ConfigError) as err:
        check_ds_config({"activation_checkpointing": section}, "c.json")
    message = str(err.value)
    assert "\n" not in message and message.startswith("DeepSpeed config c.json: activation_checkpointing")
    for needle in needles:
        assert needle in message, message


def test_deepspeed_keys_that_ask_for_nothing_are_accepted():
    section = {"partition_activations": False, "contiguous_memory_optimization": False, "number_checkpoints": None,
               "synchronize_checkpoint_boundary": False, "profile": False, "cpu_checkpointing": True}  # fmt: skip
    check_ds_config({"activation_checkpointing": section}, "c.json")
    assert cpu_checkpointing({"activation_checkpointing": section})
    assert not cpu_checkpointing({}) and not cpu_checkpointing({"activation_checkpointing": {}})


def _config(tmp_path, checkpointing=None, deepspeed=None):
    config = json.loads(BASE.read_text())
    if checkpointing is not None:
        config["mtraining"]["activation_checkpointing"] = checkpointing
    if deepspeed is not None:
        config["activation_checkpointing"] = deepspeed
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_contradictions_between_the_sections_are_refused(tmp_path):
    path = _config(tmp_path, {"layers": "none"}, {"cpu_checkpointing": True})
    refused = r'cpu_checkpointing is true but .*layers is "none".*set cpu_checkpointing false'
    with pytest.raises(ConfigError, match=refused):
        deepspeed_config(path, 1)
    with pytest.raises(ConfigError, match=r'mtraining.activation_checkpointing: keep_attention .* layers is "none"'):
        MTrainingConfig.from_deepspeed_config({"mtraining": {"activation_checkpointing": {"layers": "none",
                                                                                          "keep_attention": True}}})
    for bad in (0, -2, "some", 1.5):
        with pytest.raises(ConfigError, match="activation_checkpointing.layers"):
            MTrainingConfig.from_deepspeed_config({"mtraining": {"activation_checkpointing": {"layers": bad}}})


@pytest.mark.parametrize(
    "checkpointing,deepspeed,shown",
    [
        (None, None, "activation checkpointing on every decoder layer, checkpoints in GPU memory"),
        ({"layers": 3}, {"cpu_checkpointing": True},
         "activation checkpointing on every 3th decoder layer (2 of 4), checkpoints in CPU memory (cpu_checkpointing)"),
        ({"layers": "none"}, None, "no activation checkpointing (every layer keeps its activations)"),
    ],
)  # fmt: skip
def test_the_banner_says_what_is_checkpointed_and_where(tmp_path, checkpointing, deepspeed, shown):
    path = _config(tmp_path, checkpointing, deepspeed)
    text = describe(plan(parse_args(["--deepspeed", str(path), "--output-dir", str(tmp_path / "out")])))
    assert shown in text.splitlines()[0], text
