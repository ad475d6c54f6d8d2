"""What one training run is asked to do, besides the DeepSpeed JSON: the job's command-line settings, checked.

The command line (``launch/train.py``, :mod:`.cli`) and code that builds a :class:`~.trainer.Trainer` itself (tests,
benchmarks) fill the same :class:`TrainSettings`; its defaults are the job's defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["DEFAULT_DS_CONFIG", "TrainSettings", "UsageError"]

DEFAULT_DS_CONFIG = str(Path(__file__).resolve().parents[2] / "ds_configs" / "zero2_offload.json")
"""The shipped ZeRO-2 + CPU optimizer offload config (in a source checkout, where the job runs from)."""


class UsageError(ValueError):
    """A setting cannot be used; the message says which and why."""


@dataclass(frozen=True)
class TrainSettings:
    """One run's settings (each named after its ``launch/train.py`` flag).

    Attributes:
        deepspeed: the DeepSpeed JSON config (engine settings, and ours under ``"mtraining"``).
        model: ``tiny-qwen2``, ``smollm2-135m``, a Hugging Face folder, or a config-only folder / ``config.json``.
        data: packed rows from ``launch/prepare_data.py`` (default: synthetic copies for a model without tokenizer,
            the bundled corpus for one with).
        heldout: packed held-out rows; their mean loss is logged as ``heldout_loss``.
        heldout_rows: how many held-out rows are evaluated.
        heldout_every: evaluate the held-out rows every N steps too (0: after the last only).
        rope_kind, rope_factor: RoPE scaling past the trained context (``None``: none).
        seqlen: tokens per sequence.
        steps: optimizer steps to reach, counting resumed ones.
        output_dir: metrics, loss plot and checkpoints go here.
        save_interval: checkpoint every N steps too (0: only at the end).
        no_save: write no checkpoint at all.
        resume: continue from ``output_dir/checkpoints/latest``.
        seed: model init and data seed.
    """

    deepspeed: str = DEFAULT_DS_CONFIG
    model: str = "tiny-qwen2"
    data: str | None = None
    heldout: str | None = None
    heldout_rows: int = 4
    heldout_every: int = 0
    rope_kind: Literal["linear", "yarn", "ntk"] | None = None
    rope_factor: float = 2.0
    seqlen: int = 8192
    steps: int = 8
    output_dir: str = "runs/train"
    save_interval: int = 0
    no_save: bool = False
    resume: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.seqlen < 2:
            raise UsageError(f"--seqlen must be at least 2 tokens; got {self.seqlen}")
        if self.steps < 1 or self.save_interval < 0:
            raise UsageError(
                f"--steps must be >= 1 and --save-interval >= 0; got {self.steps} and {self.save_interval}"
            )
        if self.heldout_rows < 1 or self.heldout_every < 0:
            raise UsageError(
                f"--heldout-rows must be >= 1 and --heldout-every >= 0; got {self.heldout_rows} and {self.heldout_every}"
            )
        if self.rope_kind and not self.rope_factor > 1:
            raise UsageError(f"--rope-factor must be > 1 (new context / trained context); got {self.rope_factor}")
        out = Path(self.output_dir)
        taken = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
        if taken is not None:
            raise UsageError(
                f"--output-dir {self.output_dir}: {taken} is a file, not a folder; pass a folder (new or existing)"
            )

    def should_save(self, step: int) -> bool:
        """Checkpoint after ``step``: at the end of the run, and every ``save_interval`` steps (never with
        ``no_save``)."""
        if self.no_save:
            return False
        return step == self.steps or (self.save_interval > 0 and step % self.save_interval == 0)
