"""Checkpoint manifests: what a saved tag holds, byte for byte, and what a resume must keep the same.

Every tag :class:`~ds_mtraining.training.checkpoints.Checkpoints` saves carries ``manifest.json``::

    {"format": 1, "tag": "step4", "step": 4,
     "files": {"mp_rank_00_model_states.pt": {"size": 123, "sha256": "..."}, ...},
     "settings": {"seqlen": 8192, "world_size": 1, ...},
     "notes": {"sparse_attention": {...}, "lr": 0.0003, "scheduler": {...}}}

- ``files``: every file of the tag (path relative to the tag, ``/``-separated) with its size and SHA-256, so a
  resume can refuse a truncated, flipped, missing or foreign file before DeepSpeed reads any of it.
- ``settings``: what must match to resume (the architecture the weights have, the RoPE stretch they train with,
  the parallel layout the ZeRO partitions were cut for, the batch geometry and seed the data cursor counts in); see
  :func:`run_settings`. ``launch/export.py`` reads the stretch back.
- ``notes``: what may change between the save and the resume (the sparse settings but ``block_size``: pattern,
  sinks, the estimator with its budgets, overrides; the learning rate; whether packed documents are masked); a
  change is reported as a note, not refused
  (``estimator.recall``, ``estimator.max_columns``, ...; a change of ``estimator.strategy`` as one note of the
  whole estimator).

This module only reads and describes; :class:`ManifestError` carries the problem, the caller adds the fix that
depends on the other tags present (``Checkpoints``). :class:`SettingsMismatch` already holds its fix.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT",
    "MANIFEST",
    "ManifestError",
    "RunSettings",
    "SettingsMismatch",
    "build_manifest",
    "compare_run",
    "read_manifest",
    "rope_flags",
    "run_settings",
    "sha256_file",
    "verify_files",
    "write_manifest",
]

MANIFEST = "manifest.json"
FORMAT = 1
CHUNK = 16 << 20
"""Bytes read at a time while hashing (16 MiB): constant memory for files of any size."""

STATE_PATTERNS = ("*model_states.pt", "*optim_states.pt")
"""The files DeepSpeed loads a tag from: one not in the manifest is refused (another save's file mixed in)."""


class ManifestError(ValueError):
    """A tag's manifest or one of its files is wrong; the message names the file and the problem (not the fix)."""


class SettingsMismatch(ManifestError):
    """The run differs from the checkpoint in a setting that must match; the message includes the fix."""


@dataclass(frozen=True)
class RunSettings:
    """What a run records in its manifests and compares on resume.

    Attributes:
        settings: flat ``name -> value`` (JSON scalars) that must be equal to resume.
        notes: values that may change with a printed note (``sparse_attention`` as a dict, ``lr``, ``scheduler``).
    """

    settings: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)


_MODEL_KEYS = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)
_LAYOUT_KEYS = ("world_size", "dp_degree", "ulysses_degree", "ring_degree")
"""Settings the ZeRO partitions depend on (DeepSpeed cuts the optimizer state over the DP x SP ranks)."""

_FIXES = {
    "seqlen": "--seqlen {old}",
    "seed": "--seed {old}",
    "micro_batch": "train_micro_batch_size_per_gpu {old} in the DeepSpeed config",
    "gradient_accumulation": "gradient_accumulation_steps {old} in the DeepSpeed config",
    "zero_stage": "zero_optimization.stage {old} in the DeepSpeed config",
    "block_size": "mtraining.sparse_attention.block_size {old}",
    "hierarchical_ring": "the same processes per node / mtraining.parallel.inner_ring_size as the saved run",
}
"""How a run gets a setting back to the checkpoint's value; model settings: the same ``--model``."""
_ADDED = ("rope_kind", "rope_factor")
"""Settings recorded since a later version: a manifest without them is not compared on them (its run's values
are unknown)."""


def run_settings(
    *,
    model_config: Any,
    world_size: int,
    dp_degree: int,
    ulysses_degree: int,
    ring_degree: int,
    hierarchical_ring: bool,
    zero_stage: int,
    seqlen: int,
    micro_batch: int,
    gradient_accumulation: int,
    seed: int,
    sparse_attention: Mapping[str, Any],
    ds_config: Mapping[str, Any],
    document_masking: bool = False,
    rope_kind: str | None = None,
    rope_factor: float | None = None,
) -> RunSettings:
    """The :class:`RunSettings` of a run.

    Args:
        model_config: the Hugging Face config of the model (``model_type``, layers, sizes, heads, vocabulary).
        world_size, dp_degree, ulysses_degree, ring_degree, hierarchical_ring: the mesh.
        zero_stage, micro_batch, gradient_accumulation: from the DeepSpeed config.
        seqlen, seed: the command line's.
        sparse_attention: the ``mtraining.sparse_attention`` section as a JSON dict (its ``block_size`` is a
            setting; the budgets are notes).
        ds_config: the resolved DeepSpeed config (optimizer ``lr`` and scheduler parameters become notes).
        document_masking: ``mtraining.data.document_masking`` (a note).
        rope_kind, rope_factor: the RoPE stretch the run trains with (``None``: none); export reads it back.
    """
    model: dict[str, Any] = {}
    for key in _MODEL_KEYS:
        value = getattr(model_config, key, None)
        if key == "head_dim" and value is None:
            value = model_config.hidden_size // model_config.num_attention_heads
        model[f"model.{key}"] = _jsonable(value)
    settings = model | {
        "world_size": world_size,
        "dp_degree": dp_degree,
        "ulysses_degree": ulysses_degree,
        "ring_degree": ring_degree,
        "hierarchical_ring": hierarchical_ring,
        "zero_stage": zero_stage,
        "seqlen": seqlen,
        "micro_batch": micro_batch,
        "gradient_accumulation": gradient_accumulation,
        "seed": seed,
        "block_size": sparse_attention.get("block_size"),
        "rope_kind": rope_kind,
        "rope_factor": rope_factor if rope_kind else None,
    }
    scheduler = ds_config.get("scheduler") or {}
    notes = {
        "sparse_attention": _jsonable(dict(sparse_attention)),
        "lr": _jsonable((ds_config.get("optimizer") or {}).get("params", {}).get("lr")),
        "scheduler": _jsonable({"type": scheduler.get("type"), **(scheduler.get("params") or {})}),
        "document_masking": document_masking,
    }
    return RunSettings(settings=settings, notes=notes)


def _jsonable(value: Any) -> Any:
    """``value`` as JSON data (tuples as lists, non-finite floats as ``None``) so that it compares equal after a
    round trip through ``manifest.json``."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def sha256_file(path: Path) -> str:
    """SHA-256 hex digest of ``path``, read in :data:`CHUNK`-byte pieces."""
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def _tag_files(folder: Path) -> list[str]:
    """Every file below ``folder`` except the manifest, as sorted ``/``-separated relative paths."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def build_manifest(folder: Path, *, tag: str, step: int, run: RunSettings) -> dict[str, Any]:
    """The manifest of the files now in ``folder`` (hashes every one)."""
    files = {}
    for name in _tag_files(folder):
        path = folder / name
        files[name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    return {
        "format": FORMAT,
        "tag": tag,
        "step": step,
        "files": files,
        "settings": _jsonable(run.settings),
        "notes": _jsonable(run.notes),
    }


def write_manifest(folder: Path, *, tag: str, step: int, run: RunSettings) -> Path:
    """Write ``folder/manifest.json`` describing ``folder`` as tag ``tag`` at ``step`` (through a temporary file:
    a manifest is whole or absent)."""
    manifest = build_manifest(folder, tag=tag, step=step, run=run)
    path, tmp = folder / MANIFEST, folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, allow_nan=False) + "\n")
    tmp.replace(path)
    return path


def read_manifest(folder: Path) -> dict[str, Any]:
    """``folder/manifest.json`` parsed and checked for shape; raises :class:`ManifestError`."""
    path = folder / MANIFEST
    if not path.is_file():
        raise ManifestError(
            f"checkpoint {folder} has no {MANIFEST}: it was written by an older version of this job, or its save "
            "did not finish"
        )
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{path} is not valid JSON ({e}); the checkpoint's manifest is corrupt") from None
    problem = _shape_problem(manifest)
    if problem:
        raise ManifestError(f"{path} is not a manifest of this job ({problem})")
    return manifest


def _shape_problem(manifest: Any) -> str | None:
    if not isinstance(manifest, dict):
        return "not a JSON object"
    if manifest.get("format") != FORMAT:
        return f"format {manifest.get('format')!r}, this job reads format {FORMAT}"
    if not isinstance(manifest.get("tag"), str) or not isinstance(manifest.get("step"), int):
        return "no tag or step"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "no files listed"
    for name, entry in files.items():
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("size"), int)
            or not isinstance(entry.get("sha256"), str)
            or name.startswith("/")
            or ".." in name.split("/")
        ):
            return f"bad entry for {name!r}"
    if not isinstance(manifest.get("settings"), dict) or not isinstance(manifest.get("notes"), dict):
        return "no settings or notes"
    return None


def verify_files(folder: Path, manifest: Mapping[str, Any]) -> None:
    """Check ``folder`` against ``manifest``: its tag, every listed file there with its size, no model or optimizer
    state file it does not list, then every checksum (the costly part last). Reads only; raises
    :class:`ManifestError` naming the first wrong file."""
    if manifest["tag"] != folder.name:
        raise ManifestError(
            f"{folder / MANIFEST} describes checkpoint {manifest['tag']!r}, not {folder.name!r} (a copied or "
            "renamed tag)"
        )
    files: Mapping[str, Mapping[str, Any]] = manifest["files"]
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            raise ManifestError(f"checkpoint file {path} is missing ({MANIFEST} lists it)")
        size = path.stat().st_size
        if size != entry["size"]:
            raise ManifestError(
                f"checkpoint file {path} has {size} bytes, {MANIFEST} says {entry['size']}: it is truncated or "
                "was replaced"
            )
    listed = set(files)
    for pattern in STATE_PATTERNS:
        for path in sorted(folder.rglob(pattern)):
            if path.relative_to(folder).as_posix() not in listed:
                raise ManifestError(
                    f"checkpoint file {path} is not in {MANIFEST}: a state file of another save is mixed in"
                )
    for name, entry in files.items():
        if sha256_file(folder / name) != entry["sha256"]:
            raise ManifestError(
                f"checkpoint file {folder / name} does not match its SHA-256 in {MANIFEST}: it is corrupt or "
                "from another save"
            )


def _show(value: Any) -> str:
    return json.dumps(value, separators=(",", ":")) if isinstance(value, list | dict | bool) else str(value)


def _flat_notes(notes: Mapping[str, Any], whole: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``notes`` flat: the sparse keys by their own name (``sink_tokens``), the estimator's as ``estimator.<key>``
    (``estimator.max_columns``), the scheduler's as ``scheduler.<key>``, the rest as they are. A nested key named in
    ``whole`` (``"estimator"``) stays one value."""
    flat: dict[str, Any] = {}
    for key, value in notes.items():
        if isinstance(value, Mapping):
            prefix = "" if key == "sparse_attention" else f"{key}."
            for k, v in value.items():
                name = f"{prefix}{k}"
                if isinstance(v, Mapping) and name not in whole:
                    flat |= {f"{name}.{kk}": vv for kk, vv in v.items()}
                else:
                    flat[name] = v
        else:
            flat[key] = value
    return flat


def _strategy(notes: Mapping[str, Any]) -> Any:
    """The estimator's ``strategy`` in ``notes`` (``None`` where the notes hold no estimator object: a manifest of
    the releases whose ``estimator`` was the strategy's name, beside flat budget keys)."""
    sparse = notes.get("sparse_attention")
    estimator = sparse.get("estimator") if isinstance(sparse, Mapping) else None
    return estimator.get("strategy") if isinstance(estimator, Mapping) else None


def rope_flags(kind: str | None, factor: float | None) -> str:
    """The command-line flags of a RoPE stretch as a run recorded it (``kind`` ``None``: no stretch)."""
    return f"--rope-kind {kind} --rope-factor {factor:g}" if kind else "no --rope-kind or --rope-factor"


def compare_run(manifest: Mapping[str, Any], run: RunSettings, where: str) -> list[str]:
    """Compare the checkpoint ``where``'s recorded run with this one.

    Returns one ``note: ...`` line per changed note value (``block_size`` is a setting, compared there; the
    estimator's keys one by one, ``estimator.recall``, or the whole estimator when its strategy changed). Raises
    :class:`SettingsMismatch` (one line: each differing setting with the checkpoint's and this run's value, and
    the fix) when a setting differs.
    """
    old, new = manifest["settings"], _jsonable(run.settings)
    differ = [
        key for key in dict.fromkeys([*old, *new]) if old.get(key) != new.get(key) and (key in old or key not in _ADDED)
    ]
    if differ:
        values = ", ".join(f"{key} {_show(old.get(key))} (this run: {_show(new.get(key))})" for key in differ)
        layout = [key for key in differ if key in _LAYOUT_KEYS]
        if layout:
            raise SettingsMismatch(
                f"checkpoint {where} was saved with {values}: DeepSpeed's ZeRO optimizer state is partitioned over "
                "the data x sequence parallel ranks, so it resumes only with the same world size and degrees; "
                f"launch it as before ({', '.join(f'{k} {_show(old.get(k))}' for k in layout)}), or convert the "
                "tag with DeepSpeed's universal checkpoint tool (deepspeed.checkpoint ds_to_universal), which this "
                "job does not load yet"
            )
        fixes = []
        for key in differ:
            if key.startswith("model."):
                fixes.append("the same --model (and --rope-kind) as the saved run")
            elif key in _ADDED:  # the stretch is one pair of flags
                fixes.append(rope_flags(old.get("rope_kind"), old.get("rope_factor")))
            elif key in _FIXES:
                fixes.append(_FIXES[key].format(old=_show(old.get(key))))
        fixes = list(dict.fromkeys(fixes))
        raise SettingsMismatch(
            f"checkpoint {where} was saved with {values}, which must match to resume; resume with the checkpoint's "
            f"values ({'; '.join(fixes) or 'as saved'}), or train without --resume into another --output-dir"
        )
    # Tags saved before documents could be masked trained without masking.
    saved, current = {"document_masking": False, **manifest["notes"]}, _jsonable(run.notes)
    # Another strategy has other keys: one note of the whole estimator, not one per key of either.
    whole = frozenset({"estimator"} if _strategy(saved) != _strategy(current) else ())
    old_notes, new_notes = _flat_notes(saved, whole), _flat_notes(current, whole)
    return [
        f"note: resuming with {key} {_show(new_notes.get(key))} (checkpoint: {_show(old_notes.get(key))})"
        for key in dict.fromkeys([*old_notes, *new_notes])
        if key != "block_size" and old_notes.get(key) != new_notes.get(key)
    ]
