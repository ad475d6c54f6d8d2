import os

import pytest
import torch

# Triton kernels run through its interpreter where there is no GPU; the switch must be set before any
# kernel is defined, so it lives here rather than in a test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` are skipped, with the reason, where there is no GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `pytest -m cuda tests/gpu` on a GPU machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
