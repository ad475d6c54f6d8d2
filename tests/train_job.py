"""``launch/train.py`` loaded as a module, for tests that call its functions in-process (it is a script, not a
module of the package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TRAIN = Path(__file__).resolve().parents[1] / "launch" / "train.py"


def load_train_module(name: str) -> ModuleType:
    """A fresh module of ``launch/train.py`` registered as ``sys.modules[name]`` (its dataclasses look their module
    up there); each test file passes its own ``name``, so that one file's monkeypatches never reach another's."""
    spec = importlib.util.spec_from_file_location(name, TRAIN)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
