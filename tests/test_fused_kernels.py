"""Liger's fused RMSNorm, SwiGLU and RoPE (``integration.fused_kernels``): the same training loss and every parameter's
gradient as transformers' modules (fp32), per model family and on each path of ours (activation checkpointing,
keep-attention, the tiled MLP; ZeRO-2/3 with the ring and Ulysses on two processes); the patches are undone on exit;
what is fused, or why not, in one line.

On CPU Liger's kernels run in Triton's interpreter, which needs two adapters to run them (:func:`interpretable`);
the interpreter is slow (5-40 ms per Triton program, one program per token row), so the models are tiny and short:
one decoder layer, 16 tokens (on a GPU: 128 tokens and heads of 64, what our sparse Triton kernels take). The check
of each gradient (:func:`assert_same`) is ``max|fused - ref| <= RTOL * max|ref|`` per parameter; measured on CPU: at
most 1.2e-6 (the kernels sum in another order), while the likeliest slip of a patch, RMSNorm with another epsilon,
moves the gradients by 5e-2 (:func:`test_the_check_catches_a_wrong_epsilon`).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config, Qwen3Config
from transformers.models.qwen3 import modeling_qwen3

from ds_mtraining.config import BaselineEstimator, ConfigError, MTrainingConfig, SparseAttentionConfig
from ds_mtraining.integration.batch import make_batch
from ds_mtraining.integration.fused_kernels import FAMILIES, fused_kernels_note, use_fused_kernels
from ds_mtraining.integration.loss import forward_loss
from ds_mtraining.integration.recompute import enable_activation_checkpointing
from ds_mtraining.integration.tiled_mlp import enable_tiled_mlp
from ds_mtraining.integration.transformers import MTrainingAttention

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
N, VOCAB, HEAD_DIM = (128, 96, 64) if GPU else (16, 96, 16)
RTOL = 1e-5
"""Largest error of a gradient entry allowed, relative to that gradient's largest entry (measured: <= 1.2e-6)."""
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=2 * HEAD_DIM,
    intermediate_size=4 * HEAD_DIM,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=HEAD_DIM,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,  # not Liger's default (1e-6): a patch that lost the config's epsilon would show
    sliding_window=None,  # Mistral's default window is refused by our attention
    use_cache=False,
)
CONFIGS: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
}
# Vertical-slash attention whose index takes every entry, so that fused and unfused runs attend alike whatever
# ulp their q and k differ by (an estimator choosing near a tie could pick another column otherwise). On a GPU dense
# SDPA instead: our Triton kernels' fp32 ``tl.dot`` runs in TF32 there, which turns the fused kernels' ulp-level
# differences in q and k into gradient differences of up to 1.4e-4 (measured on an H200, Qwen3's q/k norms), an
# error of our attention's precision, not of Liger's kernels; SDPA in fp32 keeps full fp32 products.
SPARSE = (
    SparseAttentionConfig(pattern="dense")
    if GPU
    else SparseAttentionConfig(
        estimator=BaselineEstimator(
            last_q=8, column_recall=1.0, diagonal_recall=1.0, max_columns=4096, max_diagonals=4096
        )
    )
)
PATHS = {  # the two-process test runs each once more: keep-attention under ZeRO-2, the tiled MLP under ZeRO-3
    "keep-attention": {"checkpointing": True, "keep_attention": True},
    "checkpointed+tiled-mlp": {"checkpointing": True, "tile": N // 2},
}


@contextlib.contextmanager
def _liger_in_the_interpreter() -> Iterator[None]:
    """Let Triton 3.9's interpreter (CPU) run Liger's RMSNorm and SwiGLU kernels; nothing to do on a GPU.

    The interpreter hands a kernel's float arguments over as Python floats (``interpreter._implicit_cvt`` wraps ints,
    bools and pointers only, "TODO: wrap everything in triton tensors") where compiled Triton passes fp32 scalars, so
    Liger's ``eps.to(tl.float32)`` fails; and it does not interpret libdevice, whose ``rsqrt`` Liger's RMSNorm calls.
    Here floats become fp32 scalars and ``rsqrt`` is ``tl.math.rsqrt``, which the interpreter does run. The kernels'
    own code is unchanged.
    """
    if GPU:
        yield
        return
    import triton.language as tl
    from liger_kernel.ops import rms_norm
    from triton.runtime import interpreter

    convert = interpreter._implicit_cvt

    def float_as_fp32(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return convert(arg)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter, "_implicit_cvt", float_as_fp32)
        patch.setattr(rms_norm, "rsqrt", lambda x: tl.math.rsqrt(x))
        yield


@pytest.fixture
def interpretable() -> Iterator[None]:
    with _liger_in_the_interpreter():
        yield


def tiny_config(family: str, **changes) -> PretrainedConfig:
    return CONFIGS[family](**(TINY | changes))


def build(config: PretrainedConfig, device: torch.device | str = "cpu") -> torch.nn.Module:
    """As ``ModelSpec.build`` builds a random init: our attention, fp32, seed 0."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation="mtraining", dtype=torch.float32
    )
    return model.to(device).train()


def loss_and_grads(
    config: PretrainedConfig,
    fused: bool,
    *,
    checkpointing: bool = False,
    keep_attention: bool = False,
    tile: int | None = None,
    calls: dict[str, int] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The training loss (``forward_loss``) of one random row and every parameter's gradient; ``calls`` (from
    :func:`kernel_calls`) is emptied once inside the context (entering it on CPU tries each kernel once)."""
    with use_fused_kernels(config, fused):
        if calls is not None:
            calls.clear()
        model = build(config, DEVICE)
        if checkpointing:
            enable_activation_checkpointing(model, keep_attention=keep_attention)
        if tile is not None:
            enable_tiled_mlp(model, tile)
        ids = torch.randint(0, VOCAB, (1, N), generator=torch.Generator().manual_seed(1))
        loss = forward_loss(model, make_batch(ids, mesh=None, layout=None, pad_id=0), MTrainingAttention(SPARSE))
        loss.backward()
    return loss.detach().cpu(), {name: p.grad.cpu() for name, p in model.named_parameters()}


def relative_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter: ``max|got - want| / max|want|``."""
    assert got.keys() == want.keys()
    return {name: float((got[name] - want[name]).abs().max() / want[name].abs().max()) for name in want}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str = "") -> None:
    assert all(g.abs().max() > 0 for g in want.values()), where  # every parameter gets a gradient
    errors = relative_errors(got, want)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= RTOL, f"{where} {worst}: relative error {errors[worst]:.2e} > {RTOL:.0e} ({errors})"


@pytest.fixture
def kernel_calls(monkeypatch) -> dict[str, int]:
    """Calls of Liger's RMSNorm, SwiGLU and RoPE autograd functions (forward), by kernel."""
    from liger_kernel.ops import rope
    from liger_kernel.transformers import rms_norm, swiglu

    calls: dict[str, int] = {}
    for kernel, module, name in (
        ("RMSNorm", rms_norm, "LigerRMSNormFunction"),
        ("SwiGLU", swiglu, "LigerSiLUMulFunction"),
        ("RoPE", rope, "LigerRopeFunction"),
    ):

        def counting(*args, real=getattr(module, name), kernel=kernel):
            calls[kernel] = calls.get(kernel, 0) + 1
            return real.apply(*args)

        monkeypatch.setattr(module, name, type(name, (), {"apply": staticmethod(counting)}))
    return calls


@pytest.mark.parametrize("family", list(CONFIGS))
def test_same_loss_and_gradients_as_transformers(interpretable, kernel_calls, family):
    """Also: the fused forward called Liger's RMSNorm per norm, SwiGLU per MLP and RoPE per attention (the RoPE
    patch is looked up at forward time, so this shows that it is in place while the model runs)."""
    config = tiny_config(family)
    ref_loss, ref_grads = loss_and_grads(config, False)
    assert not kernel_calls
    loss, grads = loss_and_grads(config, True, calls=kernel_calls)
    norms = 5 if family == "qwen3" else 3  # input, post-attention, (q, k,) final
    assert kernel_calls == {"RMSNorm": norms, "SwiGLU": 1, "RoPE": 1}, kernel_calls
    assert_same(grads, ref_grads, family)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)


@pytest.mark.parametrize("path", list(PATHS))
def test_same_gradients_on_each_path(interpretable, path):
    """Checkpointing recomputes the fused forward inside the backward, keep-attention reuses the forward's attention
    output, the tiled MLP calls ``LigerSwiGLUMLP.forward`` per tile: each against the same path unfused. Qwen3: the
    family with the most fused modules (its per-head q/k norms)."""
    config = tiny_config("qwen3")
    ref_loss, ref_grads = loss_and_grads(config, False, **PATHS[path])
    loss, grads = loss_and_grads(config, True, **PATHS[path])
    assert_same(grads, ref_grads, path)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)


def test_the_check_catches_a_wrong_epsilon():
    """The check is tight: RMSNorm with epsilon 1e-6 instead of the config's 1e-5 (Liger's default instead of the
    model's, a patch's most likely slip) changes the gradients by far more than ``RTOL`` (unfused, so it is quick)."""
    _, want = loss_and_grads(tiny_config("llama"), False)
    _, got = loss_and_grads(tiny_config("llama", rms_norm_eps=1e-6), False)
    assert max(relative_errors(got, want).values()) > 100 * RTOL
    with pytest.raises(AssertionError, match="relative error"):
        assert_same(got, want)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_fused_modules_inside_and_originals_restored_after(interpretable, family):
    """Inside: the model is built from Liger's classes, with the config's epsilon and the same random init (so seeds
    and checkpoints carry over). After: the module's attributes are transformers' again, also after an error, and a
    model built then has transformers' classes."""
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    config = tiny_config(family)
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    names = [f"{FAMILIES[family]}RMSNorm", f"{FAMILIES[family]}MLP", "apply_rotary_pos_emb"]
    originals = {name: getattr(module, name) for name in names}
    plain = build(config)
    with pytest.raises(RuntimeError, match="stop"), use_fused_kernels(config, True) as note:
        assert note.startswith("fused kernels: Liger RMSNorm, SwiGLU, RoPE, linear cross-entropy (liger-kernel 0.8")
        assert all(getattr(module, name) is not originals[name] for name in names)
        fused = build(config)
        raise RuntimeError("stop")
    assert {name: getattr(module, name) for name in names} == originals
    norms = [m for m in fused.modules() if isinstance(m, LigerRMSNorm)]
    assert len(norms) == 2 * config.num_hidden_layers + 1 + (2 * config.num_hidden_layers if family == "qwen3" else 0)
    assert all(m.variance_epsilon == config.rms_norm_eps for m in norms)
    assert all(isinstance(layer.mlp, LigerSwiGLUMLP) for layer in fused.model.layers)
    fused_state, plain_state = fused.state_dict(), plain.state_dict()
    assert fused_state.keys() == plain_state.keys()
    assert all(torch.equal(fused_state[k], plain_state[k]) for k in plain_state)
    after = build(config)
    assert type(after.model.norm) is originals[f"{FAMILIES[family]}RMSNorm"]
    assert type(after.model.layers[0].mlp) is originals[f"{FAMILIES[family]}MLP"]
    assert not any(isinstance(m, (LigerRMSNorm, LigerSwiGLUMLP)) for m in after.modules())


def test_notes_and_refusals():
    llama = tiny_config("llama")
    assert fused_kernels_note(llama, False).note == "fused kernels: off (config)"
    phi = PretrainedConfig()
    phi.model_type = "phi3"
    off = fused_kernels_note(phi, "auto")
    assert not off.apply and off.note.startswith("fused kernels: off: phi3 not supported (")
    refusal = r"^mtraining\.fused_kernels\.enabled = true, but phi3 not supported .*false$"
    with pytest.raises(ConfigError, match=refusal):
        fused_kernels_note(phi, True)
    biased = fused_kernels_note(tiny_config("llama", mlp_bias=True), "auto")
    assert not biased.apply and "mlp_bias=true not supported (Liger's SwiGLU MLP has no biases)" in biased.note
    gelu = fused_kernels_note(tiny_config("qwen2", hidden_act="gelu"), "auto")
    assert not gelu.apply and "hidden_act='gelu'" in gelu.note
    with use_fused_kernels(phi, "auto") as note:  # nothing patched, nothing raised
        assert note == off.note


@pytest.mark.skipif(GPU, reason="what happens without a GPU")
def test_without_a_gpu():
    """``"auto"`` stays off (the interpreter would be far slower than PyTorch); ``true`` tries the kernels on CPU
    tensors first and, as Triton 3.9's interpreter cannot run Liger's RMSNorm, stops with one line naming the key
    and the fix (before any model exists); with the interpreter adapted they run, and ``true`` fuses."""
    config = tiny_config("qwen3")
    off = "fused kernels: off: no GPU (Liger's Triton kernels need a GPU)"
    assert fused_kernels_note(config, "auto") == (False, off)
    with pytest.raises(ConfigError) as error:
        with use_fused_kernels(config, True):
            pytest.fail("entered")
    message = str(error.value)
    assert "\n" not in message and message.startswith(
        "mtraining.fused_kernels.enabled = true, but Liger's Triton kernels do not run without a GPU (RMSNorm: "
    )
    assert message.endswith('set it to "auto" (fused where a GPU is present) or false')
    assert modeling_qwen3.Qwen3RMSNorm.__module__ == modeling_qwen3.__name__  # nothing was patched
    with _liger_in_the_interpreter():
        assert fused_kernels_note(config, True) == (
            True,
            "fused kernels: Liger RMSNorm, SwiGLU, RoPE, linear cross-entropy (liger-kernel 0.8.5, in Triton's interpreter: no GPU)",
        )


def test_config_option():
    assert MTrainingConfig().fused_kernels.enabled == "auto"
    for value in (True, False, "auto"):
        loaded = MTrainingConfig.from_deepspeed_config({"mtraining": {"fused_kernels": {"enabled": value}}})
        assert loaded.fused_kernels.enabled == value
    for value in ("yes", "true", 1, None):
        with pytest.raises(ConfigError, match=r'mtraining\.fused_kernels\.enabled = .*: use true, false or "auto"$'):
            MTrainingConfig.from_deepspeed_config({"mtraining": {"fused_kernels": {"enabled": value}}})
    with pytest.raises(ConfigError, match=r"fused_kernels\.on: unknown key; allowed keys: enabled"):
        MTrainingConfig.from_deepspeed_config({"mtraining": {"fused_kernels": {"on": True}}})


# ---- ZeRO-2 / ZeRO-3 with the ring and Ulysses: two processes ----

SP_CONFIG = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
"""Qwen2 (no per-head norms: fewer Triton programs to interpret) with heads for Ulysses 2."""
SP_CASES = [  # (ZeRO stage, Ulysses, ring, tokens: 64 per ring rank (a stripe), keep_attention, tokens per MLP tile)
    (2, 1, 2, 128, True, None),
    (3, 2, 1, 64, False, 16),
]


def _engine_step(mesh, layout, stage: int, n: int, fused: bool, keep_attention: bool, tile: int | None):
    """One DeepSpeed step of a tiny Qwen2 on this rank's shard of ``n`` tokens, checkpointed as the trainer does,
    built and run inside ``use_fused_kernels``: the loss, every parameter's full gradient before the step and its
    fp32 weight after it."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from ds_mtraining.integration.deepspeed import MeshMPU, sum_sequence_parallel_gradients

    zero = {"stage": stage, "contiguous_gradients": True, "overlap_comm": False, "reduce_bucket_size": 5000}
    if stage == 3:  # partition even the tiny model's parameters (all under the persistence threshold otherwise)
        zero |= {"stage3_param_persistence_threshold": 0, "stage3_model_persistence_threshold": 0}
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.1, "torch_adam": True}},
        "steps_per_print": 1000,
    }
    config = tiny_config("qwen2", **SP_CONFIG)
    with use_fused_kernels(config, fused):
        model = build(config)
        enable_activation_checkpointing(model, keep_attention=keep_attention)
        if tile is not None:
            enable_tiled_mlp(model, tile)
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config, mpu=MeshMPU(mesh)
        )
        sum_sequence_parallel_gradients(engine)
        tokens = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(3))
        attention = MTrainingAttention(SPARSE, mesh=mesh, layout=layout)
        loss = forward_loss(engine, make_batch(tokens, mesh=mesh, layout=layout, pad_id=0), attention)
        engine.backward(loss)
        grads = {name: safe_get_full_grad(p).clone() for name, p in engine.module.named_parameters()}
        engine.step()
        weights = {name: safe_get_full_fp32_param(p).clone() for name, p in engine.module.named_parameters()}
        engine.destroy()
    return loss.detach(), grads, weights


def _sequence_parallel_worker(rank: int, world: int) -> None:
    import logging
    import os

    import deepspeed

    from ds_mtraining.parallel.mesh import Mesh, MeshShape

    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed.utils.logger.setLevel(logging.ERROR)
    with _liger_in_the_interpreter():
        for stage, ulysses, ring, n, keep_attention, tile in SP_CASES:
            shape = MeshShape.build(world=world, ulysses=ulysses, ring=ring, q_heads=4, kv_heads=2)
            mesh = Mesh(shape)
            layout = shape.layout(n, kind="striped", block_size=64, stripe=None)
            where = f"rank {rank}, ZeRO-{stage}, {shape.describe()}"
            ref_loss, ref_grads, ref_weights = _engine_step(mesh, layout, stage, n, False, keep_attention, tile)
            loss, grads, weights = _engine_step(mesh, layout, stage, n, True, keep_attention, tile)
            assert_same(grads, ref_grads, where)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0, msg=lambda m: f"loss {where}: {m}")
            # Adam's first step moves a weight by about lr (1e-3) whatever its gradient's size: 1 % of that. (An
            # entry whose gradient is near Adam's eps moves by a share of lr that a small gradient error shifts.)
            for name, weight in weights.items():
                torch.testing.assert_close(
                    weight, ref_weights[name], rtol=0, atol=1e-5, msg=lambda m, name=name: f"{name} {where}: {m}"
                )


@pytest.mark.skipif(GPU, reason="the two-process harness is CPU and gloo")
def test_zero_stages_ring_and_ulysses():
    """Two processes: ZeRO-2 with a ring of 2 (keep-attention checkpointing) and ZeRO-3 with Ulysses 2 (plain
    checkpointing, the MLP in tiles of 16 of the rank's 32 tokens): a DeepSpeed step unfused and one fused on the
    same shards, whose losses, full gradients and weights after the step agree on every rank."""
    from distributed import run_distributed

    run_distributed(2, _sequence_parallel_worker, timeout=240)
