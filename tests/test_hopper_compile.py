"""Every Triton kernel compiles for sm_90 (H100/H200), checked without a GPU (``tests/hopper_compile.py``).

The interpreter that runs the kernels in the other CPU tests never compiles them; this test does, for the dtypes
and shapes that training uses, in a process of its own (the interpreter switch of ``conftest.py`` must be off
there before Triton is imported). Kernels compiled before are reused from Triton's cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("hopper_compile.py")
ATTENTION = {"_fwd_kernel", "_bwd_preprocess_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel", "_bwd_col_kernel"}
ESTIMATOR = {
    "_stats_kernel",
    "_evidence_kernel",
    "_candidate_kernel",
    "_pick_kernel",
    "_rank_kernel",
    "_density_kernel",
}


def _compile(*args: str) -> tuple[int, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"hopper_compile.py printed no report (rc {done.returncode}):\n{done.stdout}\n{done.stderr[-3000:]}"
    return done.returncode, json.loads(lines[-1])


def test_every_kernel_compiles_for_sm90():
    rc, report = _compile()
    assert report["failed"] == [], "\n".join(report["failed"])
    assert rc == 0
    missing = (ATTENTION | ESTIMATOR) - set(report["compiled"])
    assert not missing, f"kernels never reached: {sorted(missing)}"


def test_a_kernel_the_compiler_rejects_is_reported():
    rc, report = _compile("--self-check")
    assert rc == 1
    assert len(report["failed"]) == 1 and report["failed"][0].startswith("self-check: CompilationError"), report
