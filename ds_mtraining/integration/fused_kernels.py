"""Liger Kernel's fused RMSNorm, SwiGLU MLP and RoPE in place of transformers' own, for Llama, Qwen2, Qwen3, Mistral.

Outside the attention, a decoder layer spends its memory traffic on small element-wise chains that PyTorch runs as
one kernel per operation, each writing a full-size intermediate: RMSNorm (square, mean, rsqrt, scale, cast over
``[N, hidden]``), SwiGLU's ``silu(gate) * up`` (``[N, intermediate]``) and RoPE (``q * cos + rotate_half(q) * sin``
over q and k). Liger Kernel (LinkedIn, Apache-2.0) runs each as one Triton kernel per pass, forward and backward, and
keeps less for backward (RMSNorm its input and one fp32 ``rstd`` per row; SwiGLU ``gate`` and ``up``, recomputing
``silu``). We use it rather than writing these kernels: they are generic (nothing in them is specific to our sparse
attention), maintained and tested upstream against transformers' modules, and already in our environment; our own
Triton work stays on the sparse attention. The same switch puts Liger's fused linear cross-entropy in place of our
tiled loss (``integration.loss.forward_loss(fused=True)``; the measurement that chose it is in that module).

What is patched (:func:`use_fused_kernels`), as Liger's ``apply_liger_kernel_to_<family>(model=None,
cross_entropy=False, fused_linear_cross_entropy=False)`` does it, but undoably: three attributes of
``transformers.models.<family>.modeling_<family>``:

- ``<Family>RMSNorm`` -> ``LigerRMSNorm`` (same constructor ``(hidden_size, eps)``, same ``weight``; Llama casting:
  ``rstd`` in fp32, ``weight * (x * rstd).to(dtype)``). Qwen3's per-head ``q_norm``/``k_norm`` are built from the
  same class and are fused too.
- ``<Family>MLP`` -> ``LigerSwiGLUMLP`` (same ``gate_proj``/``up_proj``/``down_proj``, no biases).
- ``apply_rotary_pos_emb`` -> Liger's Triton RoPE (``LigerRopeFunction``), which the attention modules look up in
  that module at every forward: the patch stays in place for the whole run, not only while the model is built.

Classes, not instances (Liger's ``model=...`` path rebinds each module's ``forward``): the model must be built inside
the context, and then every path that calls a module's class sees Liger's, as the tiled MLP does
(``ds_mtraining.integration.tiled_mlp`` calls ``type(mlp).forward`` tile by tile). The state dict's keys and the
random init are unchanged (the same parameters, created in the same order), so checkpoints load either way.

In place. Liger's RMSNorm backward writes its input's gradient into the incoming gradient's storage, its RoPE
rotates q and k in place in the forward and their gradients in place in the backward, and its SwiGLU backward
overwrites the ``gate``/``up`` activations it saved. This is harmless in these families on every path of ours: each
RMSNorm's output feeds only linear layers (or, in Qwen3, RoPE), never a residual add, so the gradient it overwrites
is a fresh sum that nothing reads afterwards (Gemma2, whose norm outputs are added to the residual, is where Liger
turns this off); RoPE's q and k are projections nobody saved; activation checkpointing, keep-attention and the tiled
MLP recompute their activations in each backward. (Measured on CPU: RMSNorm with ``in_place=False`` gives bitwise the
same gradients on these paths.) ``tests/test_fused_kernels.py`` checks the loss and every gradient
against transformers' modules on all of these paths, ZeRO-2/3, Ulysses and the ring included. What it would break:
a second backward through the same graph without recomputation (``retain_graph=True``: SwiGLU's saved activations
are gone), which training never runs.

Where they run: Liger's kernels are Triton GPU kernels. On CPU Triton 3.9's interpreter (``TRITON_INTERPRET=1``) runs
their RoPE but not their RMSNorm or SwiGLU (measured: it passes float arguments as Python floats, on which Liger
calls ``.to(tl.float32)``, and does not interpret libdevice's ``rsqrt``); without the interpreter Triton finds no
driver. ``"auto"`` therefore fuses on CUDA only; ``true`` without a GPU first tries the three kernels on CPU tensors
and raises :class:`~ds_mtraining.config.ConfigError` at start-up when they fail, instead of failing in the first step.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from importlib import metadata
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch

from ..config import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["FAMILIES", "FusedKernels", "fused_classes", "fused_kernels_note", "use_fused_kernels"]

FAMILIES: dict[str, str] = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
"""``config.model_type`` -> the prefix of its classes in ``transformers.models.<model_type>.modeling_<model_type>``."""

KEY = "mtraining.fused_kernels.enabled"
_FIX = 'set it to "auto" (fused where a GPU is present) or false'


class FusedKernels(NamedTuple):
    """Whether :func:`use_fused_kernels` patches, and the start-up banner's line saying so."""

    apply: bool
    note: str


def fused_kernels_note(model_config: PretrainedConfig, enabled: bool | Literal["auto"]) -> FusedKernels:
    """Decide whether Liger's kernels replace transformers' for a model of ``model_config``.

    ``enabled``: ``"auto"`` fuses a supported family where CUDA is available; ``True`` fuses or raises; ``False``
    never fuses. Off, the note says why: ``"fused kernels: off (config)"``, ``"fused kernels: off: phi3 not
    supported (...)"``, ``"fused kernels: off: no GPU (Liger's Triton kernels need a GPU)"``.

    Raises:
        ConfigError: ``enabled=True`` and the family is not supported, liger-kernel is not installed, or there is
            no GPU and Liger's kernels fail on CPU tensors; one line naming the key and the fix.
    """
    if enabled is False:
        return FusedKernels(False, "fused kernels: off (config)")
    unsupported = _unsupported(model_config)
    if unsupported is not None:
        if enabled is True:
            raise ConfigError(f"{KEY} = true, but {unsupported}; {_FIX}")
        return FusedKernels(False, f"fused kernels: off: {unsupported}")
    try:
        version = metadata.version("liger-kernel")
    except metadata.PackageNotFoundError:
        if enabled is True:
            raise ConfigError(f"{KEY} = true, but liger-kernel is not installed; pip install liger-kernel, or {_FIX}")
        return FusedKernels(False, "fused kernels: off: liger-kernel is not installed")
    fused = f"fused kernels: Liger RMSNorm, SwiGLU, RoPE, linear cross-entropy (liger-kernel {version}"
    if torch.cuda.is_available():
        return FusedKernels(True, f"{fused})")
    if enabled == "auto":  # in Triton's interpreter they would be orders of magnitude slower than PyTorch's modules
        return FusedKernels(False, "fused kernels: off: no GPU (Liger's Triton kernels need a GPU)")
    failure = _cpu_failure()
    if failure is not None:
        raise ConfigError(f"{KEY} = true, but Liger's Triton kernels do not run without a GPU ({failure}); {_FIX}")
    return FusedKernels(True, f"{fused}, in Triton's interpreter: no GPU)")


@contextlib.contextmanager
def use_fused_kernels(model_config: PretrainedConfig, enabled: bool | Literal["auto"]) -> Iterator[str]:
    """While inside, models of ``model_config``'s family are built with, and run, Liger's RMSNorm, SwiGLU MLP and
    RoPE (when :func:`fused_kernels_note` says so); on exit transformers' own are restored, also after an error.

    Wrap the whole run, model construction first: the model's modules are created from the patched classes, and its
    attention modules look ``apply_rotary_pos_emb`` up at each forward. Shapes and dtypes are those of the modules
    replaced (``[B, N, hidden]`` activations, any float dtype; fp32 ``rstd``). Nested uses restore in order.

    Yields:
        the start-up banner's line, e.g. ``"fused kernels: Liger RMSNorm, SwiGLU, RoPE, linear cross-entropy (liger-kernel 0.8.5)"``.

    Raises:
        ConfigError: as :func:`fused_kernels_note`, before anything is patched.
    """
    decision = fused_kernels_note(model_config, enabled)
    with fused_classes(model_config) if decision.apply else contextlib.nullcontext():
        yield decision.note


@contextlib.contextmanager
def fused_classes(model_config: PretrainedConfig) -> Iterator[None]:
    """The patch of :func:`use_fused_kernels` without its decision, for a caller that has decided already
    (``fused_kernels_note(...).apply``, as the training plan records it): ``model_config``'s family must be one
    of :data:`FAMILIES`."""
    family = model_config.model_type
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    replacements = _replacements(FAMILIES[family])
    originals = {name: getattr(module, name) for name in replacements}  # an AttributeError names a renamed class
    try:
        for name, replacement in replacements.items():
            setattr(module, name, replacement)
        yield
    finally:
        for name, original in originals.items():
            setattr(module, name, original)


def _replacements(prefix: str) -> dict[str, object]:
    """The module attributes Liger's ``apply_liger_kernel_to_<family>`` replaces for RMSNorm, SwiGLU and RoPE."""
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    return {f"{prefix}RMSNorm": LigerRMSNorm, f"{prefix}MLP": LigerSwiGLUMLP, "apply_rotary_pos_emb": _liger_rope}


def _liger_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin)``: q ``[B, Hq, N, D]``, k ``[B, Hkv, N, D]``, cos/sin
    ``[B, N, D]`` (halves repeated) -> rotated (q, k), as Liger's Triton kernel, rotating in place.

    ``LigerRopeFunction`` is called directly rather than through ``liger_rotary_pos_emb``: that one's dispatcher
    picks a CuTe DSL kernel where ``nvidia-cutlass-dsl`` is installed (another kernel on another machine) and logs a
    warning per backend it cannot import on every rank."""
    from liger_kernel.ops.rope import LigerRopeFunction

    return LigerRopeFunction.apply(q, k, cos, sin, None, unsqueeze_dim, None)


def _unsupported(model_config: PretrainedConfig) -> str | None:
    """Why Liger's modules cannot stand in for this model's, or ``None``."""
    model_type = getattr(model_config, "model_type", None) or "a model without a model_type"
    if model_type not in FAMILIES:
        return f"{model_type} not supported (Liger's kernels are applied to {', '.join(FAMILIES)})"
    act = getattr(model_config, "hidden_act", None)
    if act not in ("silu", "swish"):
        return f"{model_type} with hidden_act={act!r} not supported (Liger's SwiGLU MLP computes silu)"
    if getattr(model_config, "mlp_bias", False):
        return f"{model_type} with mlp_bias=true not supported (Liger's SwiGLU MLP has no biases)"
    return None


def _cpu_failure() -> str | None:
    """``None`` when Liger's RMSNorm, SwiGLU and RoPE run forward and backward on tiny CPU tensors here (in Triton's
    interpreter), else the first failure as ``"<kernel>: <error>"``."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    def leaf(*shape: int) -> torch.Tensor:
        return torch.ones(shape, requires_grad=True)

    cos, sin = torch.ones(1, 2, 4), torch.zeros(1, 2, 4)
    kernels = {
        "RMSNorm": lambda: LigerRMSNormFunction.apply(leaf(2, 4), leaf(4), 1e-6, 0.0, "llama", True, None),
        "SwiGLU": lambda: LigerSiLUMulFunction.apply(leaf(2, 4), leaf(2, 4)),
        "RoPE": lambda: sum(LigerRopeFunction.apply(leaf(1, 1, 2, 4), leaf(1, 1, 2, 4), cos, sin, None, 1, None)),
    }
    for name, run in kernels.items():
        try:
            run().sum().backward()
        except Exception as e:  # noqa: BLE001 - whatever stops them (no driver, the interpreter) is the answer
            message = (str(e).strip().splitlines() or [""])[0][:160]
            return f"{name}: {type(e).__name__}: {message}"
    return None
