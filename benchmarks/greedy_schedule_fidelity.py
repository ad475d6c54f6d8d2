"""The fidelity harness (``launch/eval.py fidelity``) with the spread greedy's round schedule overridden.

The schedule (``estimator.spread.greedy.rounds``: most picks per head in each round, from the column cap) is not a
config knob; this runs the harness with another one to weigh fewer rounds (less GPU time) against index quality:

    python benchmarks/greedy_schedule_fidelity.py 8,32,128,512,1536 fidelity --model smollm2-135m --length 8192 \
        --masked --seed 0 --estimators spread --ds-config ds_configs/zero2.json --device cpu --threads 1 --out OUT

On CPU the greedy runs in PyTorch, on CUDA as the Triton rounds (the same rules). The estimate's CUDA graphs are
cached (by their owner, a ``GraphCache``) without the schedule in their key, which is safe here: the schedule is
replaced before the first estimate and stays fixed for the process.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from ds_mtraining.estimator.spread import greedy


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    try:
        schedule = tuple(int(x) for x in sys.argv[1].split(","))
    except ValueError:
        schedule = ()
    if not schedule or min(schedule) < 1:
        raise SystemExit(f"schedule: comma-separated positive picks per round, e.g. 8,32,128; got {sys.argv[1]!r}")
    # spread_select's default argument is what select() passes on: replace it for this process.
    greedy.spread_select.__defaults__ = (schedule, *greedy.spread_select.__defaults__[1:])
    print(f"greedy schedule: {schedule}", flush=True)
    eval_py = Path(__file__).resolve().parents[1] / "launch" / "eval.py"
    sys.argv = [str(eval_py), *sys.argv[2:]]
    runpy.run_path(str(eval_py), run_name="__main__")


if __name__ == "__main__":
    main()
