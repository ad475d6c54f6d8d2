"""ds-mtraining: DeepSpeed training on ultra-long contexts with dynamic vertical-slash sparse attention.

Tensor layout everywhere public: ``[B, N, H, D]`` (batch, tokens, heads, head dim); log-sum-exp is
``[B, H, N]``, fp32, natural log. The attention entry points are gathered in ``ds_mtraining.attention`` and
exported here. Configuration lives in ``ds_mtraining.config`` (pydantic), imported on
demand so the kernels can be used where pydantic is not installed.

The library route (README, "Train from Python"):

- ``attn_implementation="mtraining"`` works in transformers once ``ds_mtraining`` is imported: the attention is
  registered when transformers' ``modeling_utils`` loads (at once if it already has), so that ``import
  ds_mtraining`` stays free of transformers' import (about 2 s).
- :func:`deepspeed_config` turns a DeepSpeed JSON with our ``"mtraining"`` section (``ds_configs/*.json``) into what
  ``deepspeed.initialize`` takes, its ``"auto"`` values decided.
- ``ds_mtraining.training.Trainer(plan, batches=...)`` trains on the caller's micro-batches.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from typing import TYPE_CHECKING

from .attention import (
    AttentionPattern,
    Documents,
    VerticalSlashIndex,
    masked_sparse_attention,
    sparse_ring_attention,
    vertical_slash_attention,
    vertical_slash_attention_naive,
)
from .estimator import EstimateReport, estimate_index

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec
    from types import ModuleType

    from .integration.deepspeed import deepspeed_config

__version__ = "0.1.0"

__all__ = [
    "AttentionPattern",
    "Documents",
    "EstimateReport",
    "VerticalSlashIndex",
    "deepspeed_config",
    "estimate_index",
    "masked_sparse_attention",
    "sparse_ring_attention",
    "vertical_slash_attention",
    "vertical_slash_attention_naive",
]


def __getattr__(name: str):
    if name == "deepspeed_config":  # its module imports pydantic: on first use, as ds_mtraining.config is
        from .integration.deepspeed import deepspeed_config

        return deepspeed_config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_HF_ATTENTION_MODULE = "transformers.modeling_utils"
"""Where transformers defines ``AttentionInterface``, whose registry ``attn_implementation`` is checked against;
every model class imports it before it can be built."""


def _register_attention() -> None:
    """Register ``"mtraining"`` with transformers: importing the integration does it (its module level)."""
    from .integration import transformers  # noqa: F401


class _RegisterAttentionOnImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_register_attention` right after transformers' ``modeling_utils`` has executed, whoever imports it
    first; leaves ``sys.meta_path`` once it has."""

    def find_spec(self, name: str, path, target=None) -> ModuleSpec | None:
        if name != _HF_ATTENTION_MODULE:
            return None
        # The spec the rest of the import system finds, with its loader's exec_module followed by the registration.
        finders = (f for f in sys.meta_path if f is not self and hasattr(f, "find_spec"))
        spec = next((s for f in finders if (s := f.find_spec(name, path, target)) is not None), None)
        if spec is None or spec.loader is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _register_attention()

        spec.loader.exec_module = exec_module
        return spec


if _HF_ATTENTION_MODULE in sys.modules:
    _register_attention()
else:
    sys.meta_path.insert(0, _RegisterAttentionOnImport())
