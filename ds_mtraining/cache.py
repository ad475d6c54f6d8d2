"""Where the package keeps what it makes once and reuses (models converted from the wheels that ship them).

``$DS_MTRAINING_CACHE`` when set, else ``$XDG_CACHE_HOME/ds_mtraining``, else ``~/.cache/ds_mtraining``. CI points
it at an empty folder so that a missing install step fails there instead of hiding behind an earlier run's files.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV", "cache_dir"]

CACHE_ENV = "DS_MTRAINING_CACHE"
"""The environment variable that overrides the cache folder."""


def cache_dir() -> Path:
    """The package's cache folder (not created here)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "ds_mtraining"
