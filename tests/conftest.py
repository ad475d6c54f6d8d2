import os

import pytest
import torch

# Triton kernels run through its interpreter where there is no GPU; the switch must be set before any
# kernel is defined, so it lives here rather than in a test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist workers share the cores: each worker's tests, and the processes they start (which inherit
# OMP_NUM_THREADS), get the worker's share of them rather than torch's default of every core, which oversubscribes
# them (make test: 2 workers x 2 threads on 2 cores). One thread is no slower alone either: the Triton interpreter
# tests of test_triton_tile_maps.py took 215 s with one thread and 230 s with two, alone on two cores.
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` are skipped, with the reason, where there is no GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `pytest -m cuda tests/gpu` on a GPU machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
