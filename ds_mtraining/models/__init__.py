"""Pretrained models by name (``--model smollm2-135m``), and RoPE scaling for context extension.

::

    model, tokenizer = load_pretrained("smollm2-135m", dtype=torch.float32,
                                       rope=RopeScaling(kind="yarn", factor=4.0))   # 8K -> 32K positions

Loading never downloads: each name maps to a local folder made from a package installed at setup time.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from . import smollm2

__all__ = [
    "MODELS",
    "ContextError",
    "RopeScaling",
    "apply_rope_scaling",
    "head_dim",
    "check_context",
    "load_pretrained",
    "model_path",
]

MODELS: dict[str, Callable[[str | os.PathLike[str] | None], Path]] = {"smollm2-135m": smollm2.ensure_converted}
"""Model name -> function returning its local Hugging Face folder (converting once into ``cache_dir``)."""


class RopeScaling(BaseModel):
    """How to stretch a RoPE model's positions beyond its trained context.

    - ``linear``: positions divided by ``factor`` (position interpolation).
    - ``yarn``: YaRN (per-frequency interpolation plus attention temperature), original context kept.
    - ``ntk``: static NTK-aware base change, θ' = θ · factor^(d / (d − 2)), d = rotary dims.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    kind: Literal["linear", "yarn", "ntk"]
    """Scaling method."""
    factor: float = Field(gt=1.0)
    """New context / trained context, > 1."""


def model_path(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Local folder of a registered model (see :data:`MODELS`), or ``name`` itself if it is a folder."""
    if name in MODELS:
        return MODELS[name](cache_dir)
    if Path(name).is_dir():
        return Path(name)
    raise ValueError(f"unknown model {name!r}: choose one of {sorted(MODELS)} or pass a local Hugging Face folder")


def head_dim(config) -> int:
    """A transformers config's attention head dim: its ``head_dim`` where it has one, else hidden size / heads."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)

def apply_rope_scaling(config, rope: RopeScaling) -> None:
    """Set ``config.rope_parameters`` (transformers 5 format) and ``max_position_embeddings`` for ``rope``."""
    params = dict(config.rope_parameters)
    theta, trained = params["rope_theta"], config.max_position_embeddings
    if rope.kind == "ntk":
        dim = head_dim(config)
        params = {"rope_type": "default", "rope_theta": theta * rope.factor ** (dim / (dim - 2))}
    elif rope.kind == "linear":
        params = {"rope_type": "linear", "rope_theta": theta, "factor": rope.factor}
    else:
        params = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": rope.factor,
            "original_max_position_embeddings": trained,
        }
    config.rope_parameters = params
    config.max_position_embeddings = math.ceil(trained * rope.factor)


class ContextError(ValueError):
    """A length past a model's context; the message names the RoPE scaling that reaches it."""


def check_context(
    config, length: int, name: str, rope: RopeScaling | None, *, option: str = "--seqlen", fix: str | None = None
) -> None:
    """Raise :class:`ContextError` if ``length`` tokens are past ``config``'s context (after ``rope``, if any).

    The message ends with ``fix`` where the caller knows it (a resumed run: the checkpoint's own stretch), else with
    the YaRN factor, relative to the trained context, that reaches ``length``.
    """
    context = config.max_position_embeddings
    if length <= context:
        return
    if fix is None:
        trained_factor = rope.factor if rope is not None else 1.0
        factor = math.ceil(length / context * trained_factor * 10) / 10
        fix = f"stretch it, e.g. --rope-kind yarn --rope-factor {factor}"
    raise ContextError(f"{option} {length} is past {name}'s context of {context} tokens; {fix}")


def load_pretrained(
    name: str,
    *,
    dtype: torch.dtype = torch.float32,
    rope: RopeScaling | None = None,
    attn_implementation: str = "sdpa",
    cache_dir: str | os.PathLike[str] | None = None,
):
    """``(model, tokenizer)`` for a registered name or local folder, in eval mode.

    Args:
        name: ``"smollm2-135m"`` or a Hugging Face folder.
        dtype: weights' dtype (fp32 on CPUs without bf16 units; bf16 on GPU).
        rope: optional RoPE scaling for contexts past the trained length.
        attn_implementation: any name registered with transformers' ``AttentionInterface``.
        cache_dir: where converted models are kept (default: the model's own default).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = model_path(name, cache_dir)
    config = AutoConfig.from_pretrained(path)
    if rope is not None:
        apply_rope_scaling(config, rope)
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=dtype, attn_implementation=attn_implementation
    )
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)
