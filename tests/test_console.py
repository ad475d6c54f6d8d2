"""What the entry points print: no wrapping or cut progress on a pipe or file, one-line errors, quiet libraries."""

from __future__ import annotations

import io
import logging
import sys
import warnings

import pytest
from rich.console import Console

from ds_mtraining.console import make_console, print_error, track
from ds_mtraining.notices import quiet_library_notices


def _file_console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=160, soft_wrap=True, no_color=True), out


def test_console_on_a_file_does_not_wrap(capsys):
    console = make_console()  # pytest captures stdout: not a terminal
    assert not console.is_terminal
    line = "x" * 150 + " " + "y" * 150
    console.print(line)
    assert capsys.readouterr().out == line + "\n"


def test_progress_on_a_file_prints_whole_lines_and_the_last_one():
    console, out = _file_console()
    with track(console, "train", 5, completed=1, every=3600, loss="-") as bar:
        for step in range(2, 6):
            bar.advance(loss=f"{1 / step:.3f}")
    lines = out.getvalue().splitlines()
    # The first update always prints (the last line was never), then nothing for an hour, except the final one.
    assert len(lines) == 2, lines
    assert lines[0].startswith("train 2/5  loss 0.500  elapsed ") and "ETA" in lines[0]
    assert lines[1].startswith("train 5/5  loss 0.200  elapsed ") and lines[1].endswith("ETA 0:00:00")


def test_progress_every_update_when_asked():
    console, out = _file_console()
    with track(console, "eval", 3, every=0) as bar:
        for _ in range(3):
            bar.advance()
    assert [line.split("  ")[0] for line in out.getvalue().splitlines()] == ["eval 1/3", "eval 2/3", "eval 3/3"]


def test_print_error_is_one_line(capsys):
    print_error(ValueError("first part\n  second part\n"))
    assert capsys.readouterr().err == "error: first part second part\n"


def test_library_notices_are_dropped_and_others_kept(caplog):
    quiet_library_notices()
    quiet_library_notices()  # idempotent: one filter
    logger = logging.getLogger("DeepSpeed")
    assert sum(type(f).__name__ == "_DropMessages" for f in logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger="DeepSpeed"):
        logger.warning("Attempting to get learning rate from scheduler before it has started")
        logger.warning("a real problem")
    assert [r.getMessage() for r in caplog.records] == ["a real problem"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        quiet_library_notices()  # filters go on top of the "default" rule just set
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Use x.", FutureWarning, stacklevel=1)
        warnings.warn("something else is deprecated", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["something else is deprecated"]


def test_progress_bars_show_on_a_terminal_only():
    """transformers' weight-loading and GGUF bars are carriage-return art: off when stderr is a pipe or a file."""
    import subprocess
    import sys

    code = ("from ds_mtraining.notices import quiet_library_notices; quiet_library_notices(); "
            "from transformers.utils import logging; print(logging.is_progress_bar_enabled())")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"


def test_dropped_prints_removes_only_the_named_lines(capsys):
    from ds_mtraining.notices import dropped_prints

    with dropped_prints("built successfully"):
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        print("a real line")
    with pytest.raises(RuntimeError), dropped_prints("built successfully"):  # what was printed survives an error
        print("before the error")
        raise RuntimeError
    assert capsys.readouterr().out == "a real line\nbefore the error\n"
    with dropped_prints("de-quantizing GGUF tensors", stream="stderr"):  # the GGUF loader's tqdm bar, on a pipe
        from tqdm.auto import tqdm

        print("before", file=sys.stderr)
        for _ in tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
        print("after", file=sys.stderr)
    assert capsys.readouterr().err == "before\nafter\n"


def test_the_eta_leaves_out_the_first_steps_one_time_costs(monkeypatch):
    """``make run``'s first ETA was twice the real one: its first step carries the warm-up."""
    import ds_mtraining.console as console_module

    clock = iter([0.0, 20.0, 30.0, 40.0])  # start; a first step of 20 s, then 10 s a step
    monkeypatch.setattr(console_module.time, "perf_counter", lambda: next(clock))
    console, out = _file_console()
    with track(console, "train", 10, every=0) as bar:
        for _ in range(3):
            bar.advance()
    lines = out.getvalue().splitlines()
    assert [line.rsplit("ETA ", 1)[1] for line in lines] == ["?", "0:01:20", "0:01:10"], lines
