"""``launch/train.py`` for tests: launched as a job of several local processes by the ``deepspeed`` launcher, the
model folders and packed rows its flags take, and what a refusal of its flags (or another script's) must look like.
(In-process tests call ``ds_mtraining.training`` instead.)"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch
from transformers import PreTrainedConfig, PreTrainedTokenizerFast

from ds_mtraining.data.packing import pack_documents, save_packed

TRAIN = Path(__file__).resolve().parents[1] / "launch" / "train.py"


def launched_job(tmp_path: Path, processes: int, *args: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run ``launch/train.py *args`` as ``processes`` local processes through the
    ``deepspeed`` launcher and a hostfile (written into ``tmp_path``) on a free port; the environment is this
    process's without a launcher's variables, as a user's shell has it."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"localhost slots={processes}\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DS_ACCELERATOR")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    # One thread a process, as torchrun sets it: N processes with every process's default threads oversubscribe the
    # cores (a two-process job on two cores took 97 s against 52 s with one thread each).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes)))
    deepspeed = Path(sys.executable).parent / "deepspeed"
    command = [str(deepspeed), "--hostfile", str(hostfile), "--no_ssh_check", "--master_addr", "127.0.0.1",
               "--master_port", str(port), str(TRAIN), *args]  # fmt: skip
    return command, env


def refusal(status: int, captured, *needles: str) -> str:
    """What a command's refusal of its input must be (``launch/*.py``'s ``main``): exit status 2 and one ``error:``
    line on stderr holding every needle. ``status``: what ``main`` returned; ``captured``: ``capsys.readouterr()``
    after it. Returns the line."""
    err = captured.err.strip()
    assert status == 2, (status, err)
    assert err.count("\n") == 0 and err.startswith("error: "), err
    for needle in needles:
        assert needle in err, err
    return err


def save_packed_rows(directory: Path, rows: int, vocab: int = 49152) -> Path:
    """``rows`` packed rows of 512 random token ids below ``vocab`` (SmolLM2's by default; one document, seed 1)
    saved in ``directory``: data for ``--data`` / ``--heldout``."""
    gen = torch.Generator().manual_seed(1)
    document = torch.randint(1, vocab, (512 * rows + 10,), generator=gen).tolist()
    return save_packed(pack_documents([document], seqlen=512, separator=0), directory, source="test")


def save_model_with_tokenizer(directory: Path, config: PreTrainedConfig) -> Path:
    """A config-only model folder in ``directory`` (``--model`` then starts from a random init) with a word-level
    tokenizer of the config's vocabulary: token ``w<i>`` is id ``i``, ``w0`` the unknown token and ``w1`` the
    separator. What ``--data`` needs of a model, in a model that starts in seconds."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    config.save_pretrained(directory)
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(config.vocab_size)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token="w1").save_pretrained(directory)
    return directory
