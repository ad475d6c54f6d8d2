"""Models the training job can build by name (random init from a config; pretrained weights come later)."""

from __future__ import annotations

from transformers import Qwen2Config, Qwen2ForCausalLM

from . import transformers as _registration  # noqa: F401  (registers attn_implementation="mtraining")

MODELS = ("tiny-qwen2",)
"""Names ``--model`` accepts."""


def model_config(name: str, *, vocab_size: int, max_positions: int) -> Qwen2Config:
    """The architecture of ``name``: ``tiny-qwen2`` is Qwen2 with 4 layers, hidden 256, 8 heads, 2 KV heads."""
    if name != "tiny-qwen2":
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        use_cache=False,
    )


def build_model(config: Qwen2Config, *, seed: int) -> Qwen2ForCausalLM:
    """A randomly initialised causal LM with our attention (same weights for the same seed on every rank)."""
    import torch

    torch.manual_seed(seed)
    return Qwen2ForCausalLM._from_config(config, attn_implementation="mtraining")
