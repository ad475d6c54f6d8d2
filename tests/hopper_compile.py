"""Compile every Triton kernel of the package for an H100/H200 (sm_90) on a machine without a GPU.

The CPU tests run the kernels through Triton's interpreter, which never compiles them: a kernel that the
interpreter runs but the compiler rejects (a dtype its ``tl.dot`` lowers differently, an integer width, a
constexpr branch only one dtype takes) passes CI and fails on the first GPU step. This script closes that gap.
Triton compiles ahead of time for any target without its device, so the script stands in a driver that names
sm_90, turns every launch into a compile-only warm-up, and calls the package's entry points on CPU tensors in
the dtypes and shapes that training uses (bf16 at every head dim and block size of ``launch_config.py``, whole rows
and packed documents, ring shards; fp16 and fp32 once; both estimators). No kernel runs: allocations are
zero-filled so that the host code between launches stays in range.

Run as a script in a process of its own (``tests/test_hopper_compile.py`` does), without ``TRITON_INTERPRET``:
    python tests/hopper_compile.py [--self-check] [--shard=I/K]
``--self-check`` compiles one kernel the compiler rejects instead; ``--shard=I/K`` takes every K-th case from the
I-th (K processes compile on K cores). It prints one JSON line ``{"triton": version, "compiled": [kernel names],
"resources": {case: {kernel: [registers, stack bytes]}}, "failed": [messages]}`` and exits 1 when any case failed.
The resources are each kernel's registers a thread and stack frame (spilled registers) as the GPU would run it,
read from the cubin: a kernel change that makes a pass spill shows here, without a GPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: real JIT functions, not interpreted ones

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)


class _Sm90Driver:
    """What ``JITFunction.run`` asks the active driver for: the target to compile for, a device and a stream."""

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def is_active(self) -> bool:
        return True


SHARED_MEMORY = 232448
"""Bytes of shared memory one block may use on sm_90 (227 KB): a kernel that needs more fails at launch."""
COMPILED: set[str] = set()
RESOURCES: dict[str, list[int]] = {}
"""The current case's kernels (``main`` empties it before each case): each one's registers a thread and stack frame
bytes a thread (registers spilled to local memory, or local arrays), ``[registers, stack bytes]``."""
_run = JITFunction.run
_CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def _record_resources(name: str, cubin: bytes) -> None:
    """File a compiled kernel's registers and stack frame (``cuobjdump --dump-resource-usage``, from the tools Triton
    ships) in :data:`RESOURCES`: what the GPU's occupancy and spills come from, readable without a GPU."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(_CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout  # fmt: skip
    fields = dict(re.findall(r"(REG|STACK):(\d+)", usage))
    RESOURCES[name] = [int(fields["REG"]), int(fields["STACK"])]


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    if kernel.metadata.shared > SHARED_MEMORY:
        raise RuntimeError(
            f"{self.fn.__name__} needs {kernel.metadata.shared} bytes of shared memory; sm_90 has {SHARED_MEMORY}"
        )
    COMPILED.add(self.fn.__name__)
    _record_resources(self.fn.__name__, kernel.asm["cubin"])
    return kernel


def _install() -> None:
    driver.set_active(_Sm90Driver())
    JITFunction.run = _compile_only
    # Outputs of kernels that never run stay as allocated: zeros keep indices and sizes computed from them valid.
    torch.empty = lambda *a, **k: torch.zeros(*a, **k)
    torch.empty_like = lambda *a, **k: torch.zeros_like(*a, **k)
    torch.Tensor.new_empty = lambda self, *a, **k: self.new_zeros(*a, **k)


def _attention_cases() -> list[tuple[str, callable]]:
    from ds_mtraining.parallel.layout import make_layout
    from ds_mtraining.parallel.ring import shard_index
    from ds_mtraining.parallel.work import offset_shards, offsets_reaching
    from ds_mtraining.sparse import VerticalSlashIndex
    from ds_mtraining.sparse.triton import (
        backward_delta,
        prepare_tile_map,
        vertical_slash_backward,
        vertical_slash_forward,
    )

    def run(dtype: torch.dtype, d: int, bs: int, documents: bool, ring: str | None) -> None:
        """``ring``: None (one device), ``"pair"`` (rank 0's queries on rank 1's shard) or ``"group"`` (on both
        shards laid end to end, as an all-gathered ring group: the dk/dv pass walks each shard's own offsets)."""
        n, hq, hkv = 4 * bs, 4, 2
        q = torch.randn(1, n, hq, d).to(dtype)
        k, v = (torch.randn(1, n, hkv, d).to(dtype) for _ in range(2))
        vertical = torch.tensor([[[0, 1, 2, 3, bs + 5, 2 * bs + 7]]]).expand(1, hq, -1)
        index = VerticalSlashIndex.build(vertical, torch.tensor([[[0, 2]]]).expand(1, hq, -1), bs)
        starts = (torch.arange(n) // (bs + 3) * (bs + 3))[None] if documents else None
        if not ring:
            out, lse = vertical_slash_forward(q, k, v, index, d**-0.5, doc_start=starts)
            vertical_slash_backward(torch.randn_like(q), q, k, v, out, lse, index, d**-0.5, doc_start=starts)
            return
        layout = make_layout("striped", 2, n, block_size=bs)
        maps = [prepare_tile_map(layout.block_ids(r), n // bs) for r in range(2)]
        shard = [layout.shard(x, 0) for x in (q, k, v)]
        if ring == "group":
            srcs = range(2)
            maps[1] = prepare_tile_map(torch.cat([layout.block_ids(r) for r in srcs]), n // bs)
            shard[1:] = [torch.cat([layout.shard(x, r) for r in srcs], dim=1) for x in (k, v)]
            index = shard_index(index, layout.block_owner(), srcs, index.kernel_index(n), offset_shards(layout, 0),
                                maps[1], offsets_reaching(layout, 0))  # fmt: skip
        local = None if starts is None else layout.shard(starts, 0)
        out = torch.zeros_like(shard[0], dtype=torch.float32)
        lse = torch.full((1, hq, layout.local_len), float("-inf"))
        vertical_slash_forward(
            *shard, index, d**-0.5, out=out, lse=lse, q_blocks=maps[0], kv_blocks=maps[1], doc_start=local
        )
        do = torch.randn_like(shard[0])
        vertical_slash_backward(  # as the ring calls it: its shared delta, running dq and fp32 dK/dV buffer
            do, *shard, out.to(dtype), lse, index, d**-0.5, q_blocks=maps[0], kv_blocks=maps[1], doc_start=local,
            delta=backward_delta(do, out.to(dtype)), dq=torch.zeros_like(shard[0], dtype=torch.float32),
            dkv=torch.zeros((2, *shard[1].shape)),
        )  # fmt: skip

    # bf16 (what training runs) at each (head dim, block size) of launch_config.py, whole rows and documents; ring
    # shards and the other dtypes once each: every launch configuration, not their whole product.
    shapes = [(torch.bfloat16, d, 64, documents, None) for d in (64, 128) for documents in (False, True)]
    shapes += [(torch.bfloat16, d, 128, True, None) for d in (64, 128)]
    shapes += [(torch.bfloat16, 64, 64, True, ring) for ring in ("pair", "group")]
    shapes += [(torch.float16, 64, 64, True, None), (torch.float32, 64, 64, True, None)]
    cases = []
    for dtype, d, bs, documents, ring in shapes:
        name = f"attention {dtype} d{d} bs{bs}{' documents' if documents else ''}{f' ring {ring}' if ring else ''}"
        cases.append((name, lambda a=(dtype, d, bs, documents, ring): run(*a)))
    return cases


def _estimator_cases() -> list[tuple[str, callable]]:
    import ds_mtraining.sparse.index as index_module
    from ds_mtraining.config import BaselineEstimator, SparseAttentionConfig, SpreadEstimator
    from ds_mtraining.estimator import estimate_index
    from ds_mtraining.estimator.spread import candidates, evidence, greedy, report, tail
    from ds_mtraining.sparse.documents import Documents
    from ds_mtraining.sparse.pattern import AttentionPattern
    from ds_mtraining.sparse.triton import vertical_slash_backward, vertical_slash_forward

    for module in (candidates, evidence, greedy, report, tail, index_module):
        module.uses_triton = lambda device: True  # what CUDA tensors select

    def run(config: SparseAttentionConfig, n: int, heads: tuple[int, int], d: int, documents: bool) -> None:
        """The estimate, then the attention on the index it gives (its width as in training)."""
        q = torch.randn(1, n, heads[0], d).to(torch.bfloat16)
        k, v = (torch.randn(1, n, heads[1], d).to(torch.bfloat16) for _ in range(2))
        docs = Documents.from_document_ids((torch.arange(n) // 300)[None]) if documents else None
        pattern = None if docs is None else AttentionPattern(n, documents=docs)
        index, _ = estimate_index(q, k, config, softmax_scale=d**-0.5, return_report=True, pattern=pattern)
        starts = None if docs is None else docs.starts
        out, lse = vertical_slash_forward(q, k, v, index, d**-0.5, doc_start=starts)
        vertical_slash_backward(torch.randn_like(q), q, k, v, out, lse, index, d**-0.5, doc_start=starts)

    small = {
        "spread": SparseAttentionConfig(
            sink_tokens=4, estimator=SpreadEstimator(rows=32, max_columns=64, max_offsets=8)
        ),
        "baseline": SparseAttentionConfig(sink_tokens=4, estimator=BaselineEstimator(last_q=64, max_columns=50)),
    }
    cases = [
        (f"estimate {name} d{d}{' documents' if documents else ''}", lambda a=(c, 1024, (4, 2), d, documents): run(*a))
        for name, c in small.items()
        for documents, d in ((False, 128), (True, 64), (True, 128))
    ]
    # The shipped defaults at a training length: widths that grow with N and the budgets (packed documents' sinks
    # add up to max_columns columns at 32K) reach block shapes the small cases do not.
    defaults = SparseAttentionConfig()
    cases.append(("estimate defaults 32K SmolLM2 heads documents", lambda: run(defaults, 32768, (9, 3), 64, True)))
    return cases


@triton.jit
def _not_a_power_of_two(x_ptr):
    """Rejected by the compiler (``tl.arange`` needs a power-of-two length): ``--self-check`` compiles it."""
    i = tl.arange(0, 48)
    tl.store(x_ptr + i, tl.load(x_ptr + i))


def _self_check_cases() -> list[tuple[str, callable]]:
    """A case that must fail, so that a test can see this script report a kernel the compiler rejects."""
    return [("self-check", lambda: _not_a_power_of_two[(1,)](torch.zeros(64)))]


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    _install()
    failed = []
    cases = _self_check_cases() if "--self-check" in sys.argv else _attention_cases() + _estimator_cases()
    shard = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--shard=")), "0/1")
    index, count = (int(x) for x in shard.split("/"))
    resources = {}
    for name, case in cases[index::count]:
        RESOURCES.clear()
        try:
            case()
        except Exception as error:  # noqa: BLE001 -- every case is tried; the report names each failure
            last = traceback.format_exception(error)[-1].strip()
            failed.append(f"{name}: {type(error).__name__}: {last[:1500]}")
        resources[name] = dict(RESOURCES)
    report = {"triton": triton.__version__, "compiled": sorted(COMPILED), "resources": resources, "failed": failed}
    print(json.dumps(report))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
