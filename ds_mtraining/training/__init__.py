"""The training run: settings, the checked plan, and the :class:`Trainer` that runs it.

    from ds_mtraining.training import TrainSettings, Trainer, plan

    p = plan(TrainSettings(deepspeed="ds_configs/zero2_offload.json", seqlen=8192, steps=8))
    with Trainer(p) as trainer:        # what `deepspeed launch/train.py` does, without its command line
        status = trainer.fit()

``launch/train.py`` is the command line over it (:mod:`.cli`). Beside the step: the run's checkpoints and their
manifest, the stop request and the non-finite check, the metrics log and the held-out loss, the parallel shape that
``"plan": "auto"`` asks the simulator for (the memory estimate it checks against is :mod:`ds_mtraining.memory`).
"""

from .plan import INPUT_ERRORS, Plan, describe, plan
from .settings import TrainSettings, UsageError
from .trainer import Trainer

__all__ = ["INPUT_ERRORS", "Plan", "TrainSettings", "Trainer", "UsageError", "describe", "plan"]
