"""Benchmarks, checks of scale and experiments, each run from the repository root as a module:

    python -m benchmarks.<name> [options] --out FILE

Shared code, imported as ``benchmarks.<module>``: ``harness`` (device flags, timing, the report header and the
report), ``cases`` (planted indices, packed rows, planted estimator heads), ``strategies`` (the estimator settings
timed) and ``baselines`` (dense varlen SDPA, FlexAttention's tiles). Every benchmark runs in a CPU test on a tiny case
(``tests/test_bench_*.py``); the GPU correctness checks are tests (``tests/gpu``, ``pytest -m cuda tests/gpu``).
Results, with the header of each run: ``benchmarks/results/``.
"""
