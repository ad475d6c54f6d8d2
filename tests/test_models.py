import re
from pathlib import Path

import pytest
from transformers import LlamaConfig

from ds_mtraining.cache import CACHE_ENV, cache_dir
from ds_mtraining.models import ContextError, RopeScaling, apply_rope_scaling, check_context, model_path, smollm2


def _config():
    return LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, intermediate_size=64,
        vocab_size=32, max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["linear", "yarn", "ntk"])
def test_rope_scaling_extends_positions(kind):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _config()
    apply_rope_scaling(config, RopeScaling(kind=kind, factor=4.0))
    assert config.max_position_embeddings == 32768
    params = config.rope_parameters
    if kind == "ntk":  # base change: theta * 4 ** (16 / 14) for 16 rotary dims
        assert params["rope_type"] == "default" and params["rope_theta"] == pytest.approx(100000.0 * 4 ** (16 / 14))
    else:
        assert params["rope_type"] == kind and params["factor"] == 4.0
    rope = LlamaRotaryEmbedding(config)
    base = LlamaRotaryEmbedding(_config())
    # Every scaling slows the lowest frequency down (longer wavelength), and never speeds one up.
    assert float(rope.inv_freq[-1]) < float(base.inv_freq[-1])
    assert bool((rope.inv_freq <= base.inv_freq * (1 + 1e-6)).all())


def test_rope_scaling_rejects_a_shrinking_factor():
    with pytest.raises(ValueError, match="greater than 1"):
        RopeScaling(kind="linear", factor=0.5)


def test_unknown_model_name():
    with pytest.raises(ValueError, match="smollm2-135m"):
        model_path("no-such-model")


def test_local_folder_is_accepted(tmp_path):
    assert model_path(str(tmp_path)) == tmp_path


@pytest.mark.parametrize(
    "length, rope, message",
    [
        (8192, None, None),
        (16384, None, "--seqlen 16384 is past m's context of 8192 tokens; stretch it, e.g. --rope-kind yarn --rope-factor 2.0"),
        (16384, RopeScaling(kind="yarn", factor=2.0), None),
        (40000, RopeScaling(kind="yarn", factor=4.0), "--rope-factor 4.9"),  # relative to the trained 8K
    ],
)  # fmt: skip
def test_context_check_names_the_stretch_that_reaches_the_length(length, rope, message):
    config = _config()
    if rope is not None:
        apply_rope_scaling(config, rope)
    if message is None:
        check_context(config, length, "m", rope)
    else:
        with pytest.raises(ContextError, match=re.escape(message)):
            check_context(config, length, "m", rope)


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "empty"))
    assert smollm2.default_cache_dir() == tmp_path / "empty" / "smollm2-135m"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "ds_mtraining"


def test_a_conversion_finished_by_another_process_is_kept(tmp_path):
    """Two processes converting into one cache (two jobs, two test workers): the one that finishes second keeps the
    first one's folder, which that process may be reading, instead of removing it; a folder without the marker is no
    finished conversion and is replaced."""
    out = tmp_path / "smollm2"

    def conversion(name: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / smollm2._MARKER).write_text(name)
        return folder

    smollm2._publish(conversion("first"), out)
    assert (out / smollm2._MARKER).read_text() == "first"
    second = conversion("second")
    smollm2._publish(second, out)
    assert (out / smollm2._MARKER).read_text() == "first" and second.exists()
    (out / smollm2._MARKER).unlink()  # a half-written folder
    smollm2._publish(conversion("third"), out)
    assert (out / smollm2._MARKER).read_text() == "third"


def _convert_slowly(out, source=None):
    """A stand-in for the conversion: notes that it ran, takes a while, and leaves a finished folder."""
    import os
    import time

    with open(Path(out).parent / "conversions", "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(1.0)
    Path(out).mkdir()
    (Path(out) / smollm2._MARKER).write_text("done")
    return Path(out)


def _ensure_in_child(out: str, started) -> None:
    smollm2.convert = _convert_slowly  # this process's module only
    started.wait(10)
    smollm2.ensure_converted(out)


def test_processes_that_find_the_conversion_missing_together_convert_once(tmp_path):
    """Four processes (a job's ranks on one machine) ask for the converted model at once: one converts, the others
    wait on the lock and find its folder."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    started = ctx.Event()
    out = tmp_path / "smollm2-135m"
    children = [ctx.Process(target=_ensure_in_child, args=(str(out), started)) for _ in range(4)]
    for child in children:
        child.start()
    started.set()
    for child in children:
        child.join(60)
        assert child.exitcode == 0
    assert len((tmp_path / "conversions").read_text().split()) == 1
    assert (out / smollm2._MARKER).read_text() == "done"
