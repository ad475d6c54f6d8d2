"""Trained weights out as a plain Hugging Face folder that ``AutoModelForCausalLM.from_pretrained`` loads.

::

    export_checkpoint("runs/train/checkpoints", None, resolve_model("smollm2-135m"), "runs/train/hf")

The folder holds safetensors weights (in the dtype they come in: fp32 from a DeepSpeed checkpoint), the config
with the KV cache back on and no ``attn_implementation`` (transformers never writes it; a loader picks its own)
and, when the model has one, its tokenizer. It is written to a temporary sibling and renamed, so a crash never leaves a half-written folder.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from .model_loading import ModelSpec

__all__ = ["export_checkpoint", "export_hf_folder"]


def export_hf_folder(
    model_or_state_dict: torch.nn.Module | dict[str, torch.Tensor],
    config: PretrainedConfig,
    tokenizer_dir: str | os.PathLike[str] | None,
    out_dir: str | os.PathLike[str],
) -> Path:
    """Write the weights with ``config`` (and the tokenizer of ``tokenizer_dir``) as a Hugging Face folder at
    ``out_dir``; returns its path. Refuses an existing ``out_dir`` (:class:`FileExistsError`); the state dict must
    match ``config``'s architecture key for key (``load_state_dict(strict=True)``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} already exists; pass another output folder or remove it")
    state = (
        model_or_state_dict.state_dict() if isinstance(model_or_state_dict, torch.nn.Module) else model_or_state_dict
    )
    config = copy.deepcopy(config)
    config.use_cache = True  # training turned the KV cache off; generation wants it
    with torch.device("meta"):  # a model skeleton without allocating or initialising weights
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assign=True gave tied names separate tensors; save_pretrained writes tied ones once
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        if tokenizer_dir is not None:
            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the folder from other users of a shared run directory
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def export_checkpoint(
    checkpoint_dir: str | os.PathLike[str], tag: str | None, spec: ModelSpec, out_dir: str | os.PathLike[str]
) -> Path:
    """The fp32 weights of DeepSpeed (ZeRO 1-3) checkpoint ``checkpoint_dir/tag`` (``tag=None``: the one the
    ``latest`` file names) as a Hugging Face folder of ``spec``'s model (:func:`export_hf_folder`); returns its path.

    ``spec`` must be the model that was trained (same ``--model``, and for ``tiny-qwen2`` the same vocabulary and
    context; the same RoPE scaling), so that the config written describes the weights."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)
    return export_hf_folder(state, spec.config, spec.tokenizer_dir, out_dir)
