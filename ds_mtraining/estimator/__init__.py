"""The online index estimator: a strategy turns a few observation rows' attention into a vertical-slash index.

``estimate_index`` on one device; ``parallel.estimate.estimate_index_distributed`` on a ring runs the same code
with a ring reducer (:mod:`.reduce`). Strategies (:data:`ESTIMATORS`): ``"baseline"`` (:mod:`.baseline`) and
``"spread"`` (:mod:`.spread`), behind one interface (:mod:`.strategy`). On CUDA the estimate replays from the
caller's :class:`GraphCache`.
"""

from .estimate import ESTIMATORS, EstimateReport, estimate_index
from .graphs import GraphCache
from .reduce import LocalReducer, Reducer
from .strategy import Shard, Strategy

__all__ = [
    "ESTIMATORS",
    "EstimateReport",
    "GraphCache",
    "LocalReducer",
    "Reducer",
    "Shard",
    "Strategy",
    "estimate_index",
]
