"""What every benchmark shares: its device and dtype flags, timing, the report header and the report itself.

A benchmark is a module run from the repository root, ``python -m benchmarks.<name> ... --out FILE``, with a
``main(argv) -> int`` (the exit status) that the tests call on a tiny case. Its report is markdown: the lines of
:func:`header`, then its tables, printed as they come and rewritten to ``--out`` by :class:`Report`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PACKAGES = ("triton", "transformers", "deepspeed")
"""The packages whose versions every report names, after torch's."""


def add_device_args(parser: argparse.ArgumentParser) -> None:
    """``--device`` (default: the GPU if there is one) and ``--dtype`` (default: bf16 on a GPU, fp32 on CPU, where
    the Triton interpreter's bf16 ``tl.dot`` is wrong); :data:`DTYPES` maps the dtype's name to torch's."""
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16" if cuda else "fp32")


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    """``--heads``, ``--kv-heads`` and ``--head-dim`` of the attention benchmarks (defaults: Qwen2.5-3B's 16 / 2 /
    128, the shape of the recorded results)."""
    parser.add_argument("--heads", type=int, default=16, help="query heads Hq")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads Hkv")
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128))


def require_kernels(device: str) -> None:
    """Exit with a message where the Triton kernels cannot run: on CPU they need the interpreter, switched on
    before the kernels are defined (so by the caller's environment, not from here)."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("the Triton kernels run on CPU only through the interpreter: set TRITON_INTERPRET=1")


def _on_gpu(device: torch.device | str | None) -> bool:
    return torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"


def sync(device: torch.device | str | None = None) -> None:
    """Wait for the work queued on ``device`` (None: the current GPU if there is one; nothing to wait for on CPU)."""
    if _on_gpu(device):
        torch.cuda.synchronize(device)


def median_ms(
    fn: Callable[[], object],
    *,
    rep_ms: float = 200.0,
    warmup_ms: float = 25.0,
    device: torch.device | str | None = None,
) -> float:
    """Median time of one ``fn()`` in ms, ``triton.testing.do_bench``'s way.

    On a GPU (``device`` None: whenever there is one) it is ``do_bench``: CUDA events, the L2 cache flushed before
    each call, calls for ``warmup_ms`` then for ``rep_ms``; a call that alone takes ``rep_ms`` or more is timed once
    after one warm-up call (``do_bench`` would run it 7 times or more, ten minutes of device time for the 30 s
    backward of one device at 4M tokens). On CPU: one call to warm up and estimate the time, more warm-up calls while
    they fit in ``warmup_ms``, then as many calls as fit in ``rep_ms`` (at least one), each between two
    ``perf_counter`` reads.
    """
    if _on_gpu(device):
        import triton.testing

        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if start.elapsed_time(end) >= rep_ms:
            return float(start.elapsed_time(end))
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    start = time.perf_counter()
    fn()
    first = max(time.perf_counter() - start, 1e-9)
    for _ in range(int(warmup_ms / 1e3 / first)):
        fn()
    times = []
    for _ in range(max(1, int(rep_ms / 1e3 / first))):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def forward_backward_ms(
    fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], dout: torch.Tensor, *, rep_ms: float = 200.0
) -> tuple[float, float]:
    """(forward ms, forward + backward ms) of ``fn(*inputs)`` by :func:`median_ms`: the forward without autograd,
    the backward through autograd to every input from ``dout`` (shaped like the output)."""
    detached = [x.detach() for x in inputs]
    leaves = [x.detach().requires_grad_() for x in inputs]

    def forward() -> None:
        with torch.no_grad():
            fn(*detached)

    def forward_backward() -> None:
        torch.autograd.grad(fn(*leaves), leaves, dout)

    device = dout.device
    return median_ms(forward, rep_ms=rep_ms, device=device), median_ms(forward_backward, rep_ms=rep_ms, device=device)


def profile_ms(
    fn: Callable[[], object], *, runs: int = 3, device: torch.device | str | None = None
) -> dict[str, float]:
    """ms per call of each GPU kernel ``fn`` launches (on CPU: each op's own CPU time), from ``torch.profiler`` over
    ``runs`` calls after one unprofiled call; the slowest first."""
    from torch.profiler import ProfilerActivity, profile

    gpu = _on_gpu(device)
    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(runs):
            fn()
        sync(device)
    times = {}
    for event in prof.key_averages():
        us = event.self_device_time_total if gpu else event.self_cpu_time_total
        if us > 0:
            times[event.key] = us / runs / 1e3
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


class Clock:
    """Marks on the device's timeline, for phases inside one iteration (``median_ms`` times whole calls): CUDA
    events on a GPU (no host sync inside the timed region), ``perf_counter`` on CPU; :meth:`intervals` gives the ms
    between consecutive marks."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [1e3 * (b - a) for a, b in zip(self.marks, self.marks[1:])]


def tokens(n: int) -> str:
    """A token count as the tables write it: ``32768`` -> ``32K``; counts that are not whole K as they are."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device | str | None = None, count: int = 1) -> str:
    """The machine a report's numbers come from: ``count`` x the GPU's name, or the CPU's with its threads (and
    whether Triton kernels run in its interpreter, whose times say nothing about the kernels)."""
    if _on_gpu(device):
        name = torch.cuda.get_device_name(device)
        return f"{count} x {name}" if count > 1 else name
    interpreter = (
        ", Triton interpreter (kernel times mean nothing)" if os.environ.get("TRITON_INTERPRET") == "1" else ""
    )
    return f"{cpu_name()} ({torch.get_num_threads()} threads), no GPU{interpreter}"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def header(
    title: str,
    module: str,
    argv: Sequence[str] | None,
    *,
    device: torch.device | str | None = None,
    count: int = 1,
    packages: Sequence[str] = (),
    launcher: str = "python -m",
) -> list[str]:
    """A report's first lines: the title with the date (UTC), the machine (:func:`device_name`), the versions of
    torch and :data:`PACKAGES` (then ``packages``), and the exact command: ``launcher module argv`` (``argv`` None:
    this process's arguments). ``module`` is the benchmark's ``__spec__.name``, the same under ``python -m`` and
    when a test imports it."""
    cuda = f" (CUDA {torch.version.cuda})" if _on_gpu(device) else ""
    versions = [f"torch {torch.__version__}{cuda}", *(f"{p} {_version(p)}" for p in (*PACKAGES, *packages))]
    args = sys.argv[1:] if argv is None else list(argv)
    now = datetime.datetime.now(datetime.timezone.utc)
    return [
        f"# {title} — {now:%Y-%m-%d %H:%M} UTC",
        "",
        f"{device_name(device, count)} · {' · '.join(versions)}",
        "",
        f"command: `{' '.join([launcher, module, *map(shlex.quote, args)])}`",
    ]


class Report:
    """A markdown report: lines printed as they are added and the whole rewritten to ``path`` each time, so a run
    cut short keeps what it measured. ``path`` None: printed only; ``echo`` False: not printed (other ranks)."""

    def __init__(self, path: Path | str | None, *, echo: bool = True):
        self.path = None if path is None else Path(path)
        self.echo = echo
        self.lines: list[str] = []

    def add(self, *lines: str) -> None:
        if self.echo:
            print("\n".join(lines), flush=True)
        self.lines += lines
        self._write()

    def replace(self, *lines: str) -> None:
        """Every line anew (a report rebuilt whole after each row), written but not printed."""
        self.lines = list(lines)
        self._write()

    def _write(self) -> None:
        if self.path is not None:
            self.path.write_text(self.text)

    @property
    def text(self) -> str:
        return "\n".join(self.lines) + "\n"
