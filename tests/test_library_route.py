"""The library route of the README ("Train in your own loop"), one call each: the attention registered by ``import
ds_mtraining`` alone, a shipped JSON made ready for ``deepspeed.initialize`` by ``ds_mtraining.deepspeed_config``,
and the package ``Trainer`` on the caller's own batches (the same losses as the job's own rows)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_distributed

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted((REPO / "ds_configs").glob("*.json"))

_BUILD_WITH_OUR_ATTENTION = """
from transformers import AutoModelForCausalLM, Qwen2Config
config = Qwen2Config(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)
model = AutoModelForCausalLM.from_config(config, attn_implementation="mtraining")
assert model.config._attn_implementation == "mtraining"
"""


def test_import_ds_mtraining_registers_the_attention():
    """``attn_implementation="mtraining"`` after ``import ds_mtraining`` and nothing else (a fresh interpreter);
    ``import ds_mtraining`` itself does not import transformers (2 s)."""
    code = "import sys\nimport ds_mtraining\nassert 'transformers' not in sys.modules\n" + _BUILD_WITH_OUR_ATTENTION
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_deepspeed_config_decides_every_auto_and_says_how():
    import ds_mtraining

    ds_config, mtraining, notes = ds_mtraining.deepspeed_config(REPO / "ds_configs" / "zero2_offload.json", steps=50)
    assert ds_config["bf16"]["enabled"] is (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    assert ds_config["scheduler"]["params"].items() >= {"warmup_num_steps": 5, "total_num_steps": 50}.items()
    assert mtraining.sparse_attention.pattern == "vertical_slash"
    assert notes[1] == "WarmupDecayLR warm-up 5 of 50 steps"
    with pytest.raises(ValueError, match=r"^steps must be a whole number of optimizer steps >= 1; got 0$"):
        ds_mtraining.deepspeed_config(SHIPPED[0], steps=0)


def _engines(rank: int, world: int, out: str) -> None:
    """In one process (its start-up is most of the time): an engine from each shipped JSON through
    ``deepspeed_config``, then the package ``Trainer`` on the job's own rows and on the same rows as the caller's
    batches; what the tests check is written to ``out`` as JSON."""
    import copy
    import json
    import logging
    import os

    import deepspeed
    from test_train_parallel import tiny_qwen2

    import ds_mtraining
    from ds_mtraining.integration.deepspeed import optimizer_offloaded
    from ds_mtraining.training import TrainSettings, Trainer, UsageError, plan

    os.environ["LOCAL_RANK"] = str(rank)  # what a launcher sets; this process's group exists already
    deepspeed.utils.logger.setLevel(logging.ERROR)
    result: dict = {"schedules": {}, "offload": {}}
    for path in SHIPPED:
        ds_config, _, _ = ds_mtraining.deepspeed_config(path, steps=20)
        if not optimizer_offloaded(ds_config):
            # torch's AdamW: DeepSpeed's own Adam on the CPU is a JIT build of minutes that no other test needs
            ds_config["optimizer"]["params"]["torch_adam"] = True
        model = tiny_qwen2()
        engine, *_, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
        result["schedules"][path.name] = [scheduler.warmup_num_steps, scheduler.total_num_steps]
        if optimizer_offloaded(ds_config):
            result["offload"][f"{path.name}, ZeRO-2"] = _offloaded_bytes(engine, model)
            engine.destroy()
            zero3 = copy.deepcopy(ds_config)
            zero3["zero_optimization"]["stage"] = 3
            model = tiny_qwen2()
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=zero3)
            result["offload"][f"{path.name}, ZeRO-3"] = _offloaded_bytes(engine, model)
        engine.destroy()

    p = plan(TrainSettings(seqlen=256, steps=2, no_save=True, output_dir=f"{os.path.dirname(out)}/run"))
    warned: list[str] = []  # what DeepSpeed's logger lets through from here on, at the Trainer's level
    shown = logging.Handler(logging.WARNING)
    shown.emit = lambda record: warned.append(record.getMessage())
    deepspeed.utils.logger.addHandler(shown)
    with Trainer(p) as trainer:
        result["own"] = [trainer.train_step()["loss"] for _ in range(2)]
    rows = [p.data.batch([i]) for i in range(2 * p.accumulation)]  # the rows the job's own cursor drew
    with Trainer(p, batches=iter(rows)) as trainer:
        result["caller"] = [trainer.train_step()["loss"] for _ in range(2)]
        try:
            trainer.train_step()
        except UsageError as e:
            result["ran_out"] = str(e)
    with Trainer(p, batches=[rows[0][:, :128]]) as trainer:
        try:
            trainer.train_step()
        except UsageError as e:
            result["wrong_shape"] = str(e)
    result["warned"] = warned
    with open(out, "w") as f:
        json.dump(result, f)


def _offloaded_bytes(engine, model) -> list[int]:
    """After one step (Adam's moments exist from the first), the bytes of the host tensors DeepSpeed's optimizer
    offload holds, by the attributes its ZeRO-1/2 and ZeRO-3 optimizers keep them in, and what
    ``memory.offload_host_bytes`` (unpinned: on the CPU nothing is pinned) estimates for the model."""
    import torch

    from ds_mtraining.memory import offload_host_bytes

    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    model.set_attn_implementation("sdpa")  # the attention does not matter here
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    opt, stage = engine.optimizer, engine.zero_optimization_stage()
    if stage == 3:
        tensors = [*opt.fp32_partitioned_groups_flat, opt.grad_partitions_flat_buffer]
    else:
        tensors = [*opt.single_partition_of_fp32_groups, *opt.param_buffer_of_bit16_for_cpu_offload_groups,
                   opt.temp_grad_buffer_for_cpu_offload]  # fmt: skip
    tensors += [t.grad for t in tensors if t.grad is not None]
    tensors += [t for state in opt.optimizer.state.values() for t in state.values() if torch.is_tensor(t) and t.dim()]
    held = sum(t.numel() * t.element_size() for t in tensors)
    c = model.config
    expected = offload_host_bytes(
        sum(p.ds_numel if stage == 3 else p.numel() for p in model.parameters()), zero_stage=stage,
        dtype_bytes=engine.get_data_types()[0].itemsize, pinned=False,
        largest=max(c.vocab_size, c.intermediate_size, c.hidden_size) * c.hidden_size,
    )  # fmt: skip
    return [held, expected]


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict:
    import json

    out = tmp_path_factory.mktemp("library_route") / "result.json"
    # A hang guard, not a speed bound: on a fresh machine this is where DeepSpeed JIT-builds its CPU Adam (2 minutes
    # alone on 2 cores), waiting on another worker's build of it first if one holds the lock; 300 s ran out in CI.
    run_distributed(1, _engines, str(out), timeout=900)
    return json.loads(out.read_text())


def test_shipped_configs_initialize_deepspeed(engines):
    """Every ``ds_configs/*.json`` through ``deepspeed_config`` builds an engine on the CPU (as shipped, its
    ``"auto"`` values fail in ``deepspeed.initialize``), its schedule from ``steps``."""
    assert {p.name for p in SHIPPED} >= {"zero2.json", "zero2_offload.json", "dense_baseline.json"}
    assert engines["schedules"] == {p.name: [2, 20] for p in SHIPPED}


def test_the_host_memory_of_optimizer_offload_is_what_the_memory_plan_counts(engines):
    """Each shipped offload config's engine, and the same config on ZeRO-3, hold on the host exactly what the start-up
    plan's host estimate counts before pinning (``memory.offload_host_bytes``): 18 bytes a parameter and, on
    ZeRO-1/2, a buffer of the largest parameter."""
    assert set(engines["offload"]) >= {"zero2_offload.json, ZeRO-2", "zero2_offload.json, ZeRO-3"}
    for name, (held, expected) in engines["offload"].items():
        assert held == expected > 0, name


def test_trainer_on_the_callers_batches_gives_the_jobs_losses(engines):
    """The same rows give the same losses, exactly (one path from the rows on); running out, or a batch of the
    wrong shape, is one line."""
    assert engines["caller"] == engines["own"]
    # DeepSpeed's scheduler reads its own rate while deepspeed.initialize builds it and warns about that read on every
    # run: the Trainer filters it for a caller's script as the job's entry point does (ds_mtraining.notices).
    assert not [m for m in engines["warned"] if "Attempting to get learning rate" in m], engines["warned"]
    assert engines["ran_out"] == (
        "the batches ran out after 2 micro-batches, during step 3; 2 steps x accumulation 1 need 2"
    )
    assert engines["wrong_shape"] == (
        "batch 0: token ids of shape [1, 128]; each batch must be integer token ids [1, 256] "
        "(train_micro_batch_size_per_gpu x sequence length)"
    )


@pytest.mark.parametrize(
    "rows, documents, message",
    [
        ("text", False, "batch 7 is a str; each batch must be integer token ids [1, 8]"),
        ((torch.zeros(1, 8), None), False, "batch 7: token ids of dtype torch.float32; each batch must be"),
        ((torch.full((1, 8), 64), None), False, "batch 7: token ids 64..64 outside the model's vocabulary 0..63"),
        ((torch.zeros(1, 8, dtype=torch.long), None), True, "batch 7 has no document ids, but mtraining.data"),
        ((torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8)), False, "batch 7 has document ids, but"),
        ((torch.zeros(1, 8, dtype=torch.long), torch.zeros(8)), True, "batch 7: document ids [8]; they must be"),
    ],
)
def test_a_batch_it_cannot_train_on_is_one_line(rows, documents, message):
    from ds_mtraining.training.data import check_rows
    from ds_mtraining.training.settings import UsageError

    with pytest.raises(UsageError) as error:
        check_rows(rows, where="batch 7", micro_batch=1, seqlen=8, vocab_size=64, documents=documents)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_resumed_run_skips_the_callers_batches_its_checkpoint_trained_on():
    from ds_mtraining.training.data import Cursor, caller_rows

    batches = [torch.full((1, 4), i) for i in range(5)]
    cursor = Cursor(next_micro=2)  # restored from the checkpoint
    rows = caller_rows(batches, cursor)
    assert [int(tokens[0, 0]) for tokens, documents in rows] == [2, 3, 4]
    assert cursor.next_micro == 5
