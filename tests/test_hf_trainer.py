"""``transformers.Trainer`` with the sparse attention and the mesh (``integration.hf_trainer.MTrainingTrainer``), on
real gloo processes against the one-process Trainer.

One process (world 1, ZeRO-2) trains a tiny fp32 Qwen2 (RoPE stretched x2, layer 1 sparse) for 3 steps of 2
micro-batches and records each step's loss, the logged attention density and every parameter's full gradient at
the first step's boundary. Two processes then train the same model on the same rows with Ulysses 2 and with ring 2,
each under ZeRO-2 and ZeRO-3: the losses (the value the Trainer logs is the whole sequence's) and every gradient
must equal the one process's within ``tests/test_zero_stages.py``'s tolerances. The ZeRO-3 ring run also saves a
Trainer checkpoint at step 2, from which a new Trainer resumes to the same step-3 loss, and writes ``save_model``'s
folder, which plain transformers loads with the stretch in its config and the trained weights. Four processes train
two data-parallel sequence groups (ring 2 under ZeRO-2, Ulysses 2 under ZeRO-3) against one process training both
groups' rows in one micro-batch, and rows of packed documents (restarting position ids, ``document_masking``) train
to the one process's losses and gradients over ring 2 and Ulysses 2; a ring of 4 as 2 nodes of 2 (K/V passed
around the inner ring, and all-gathered in it) trains to the one process's too. The inputs the Trainer refuses are
each one line.

One spawn per world size: the processes' start-up (imports, DeepSpeed) is most of the time.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from distributed import run_distributed
from test_train_parallel import SPARSE

N = 256  # stripes of 64 over 2 ring ranks, and ring shards that 2 Ulysses ranks split
ROWS = 6  # 3 steps x accumulation 2, one data-parallel rank
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}  # tests/test_zero_stages.py's (fp32, another summation order)
LOSS_REL = 1e-5
CASES = [(2, 2, 1), (2, 1, 2), (3, 2, 1), (3, 1, 2)]  # (ZeRO stage, ulysses, ring)


def _tiny_config():
    """Qwen2 with head dim 64 (what the sparse attention serves), 2 layers, vocabulary 64, RoPE stretched x2."""
    from transformers import Qwen2Config

    from ds_mtraining.models import RopeScaling, apply_rope_scaling

    config = Qwen2Config(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=512, use_cache=False,
    )  # fmt: skip
    apply_rope_scaling(config, RopeScaling(kind="linear", factor=2.0))
    return config


def _model(config=None, attention: str = "mtraining"):
    """The model from seed 0, built whole: an earlier run's ZeRO-3 TrainingArguments would otherwise have
    transformers build it partitioned (``zero.Init``), which draws other initial weights."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    import ds_mtraining  # noqa: F401  (registers the attention)

    unset_hf_deepspeed_config()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config or _tiny_config(), attn_implementation=attention)


def _ds_config(stage: int, ulysses: int, ring: int, documents: bool = False, **parallel) -> dict:
    """A DeepSpeed config whose engine values are the Trainer's ("auto"), with the parallel degrees."""
    zero = {"stage": stage, "contiguous_gradients": True, "overlap_comm": False, "reduce_bucket_size": 5000}
    if stage == 3:  # the tiny parameters would all stay whole ("persistent") otherwise
        zero |= {"stage3_param_persistence_threshold": 0, "stage3_model_persistence_threshold": 0}
    auto = dict.fromkeys(("lr", "betas", "eps", "weight_decay"), "auto")
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": auto | {"torch_adam": True}},
        "steps_per_print": 1000,
        "mtraining": {
            "sparse_attention": SPARSE,
            "parallel": {"sequence_parallel_size": ulysses * ring, "ulysses_degree": ulysses, "ring_degree": ring}
            | parallel,
            "data": {"document_masking": documents},
        },
    }


def _rows(count: int = ROWS) -> list[dict]:
    gen = torch.Generator().manual_seed(7)
    return [{"input_ids": torch.randint(3, 64, (N,), generator=gen).tolist()} for _ in range(count)]


def _packed_rows() -> list[dict]:
    """:func:`_rows` packed: each row three documents (lengths drawn per row, one past a stripe boundary), marked by
    restarting ``position_ids`` as ``DataCollatorWithFlattening`` marks them."""
    gen = torch.Generator().manual_seed(11)
    rows = []
    for row in _rows():
        cuts = sorted(torch.randint(1, N, (2,), generator=gen).tolist())
        lengths = [cuts[0], cuts[1] - cuts[0], N - cuts[1]]
        positions = torch.cat([torch.arange(length) for length in lengths if length > 0])
        rows.append(row | {"position_ids": positions.tolist()})
    return rows


def _args(out: str, ds_config: dict, **kwargs):
    from transformers import TrainingArguments

    settings = dict(
        max_steps=3, per_device_train_batch_size=1, gradient_accumulation_steps=2, learning_rate=1e-3,
        weight_decay=0.1, adam_beta2=0.95, adam_epsilon=1e-6, max_grad_norm=1.0, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
    )  # fmt: skip
    return TrainingArguments(out, deepspeed=copy.deepcopy(ds_config), **(settings | kwargs))


def _recording_trainer():
    """``MTrainingTrainer`` that records each micro-batch's loss and, at the first accumulation boundary, every
    parameter's full gradient (before the engine's step, which the Trainer's backward runs)."""
    from deepspeed.utils import safe_get_full_grad

    from ds_mtraining.integration.hf_trainer import MTrainingTrainer

    class Recording(MTrainingTrainer):
        micro_losses: list[float]
        grads: dict[str, torch.Tensor] | None = None

        def training_step(self, model, inputs, num_items_in_batch=None):
            if not hasattr(self, "micro_losses"):
                self.micro_losses = []
                step = model.step

                def recording_step(*args, **kwargs):
                    if self.grads is None and model.is_gradient_accumulation_boundary():
                        self.grads = {n: safe_get_full_grad(p).clone() for n, p in model.module.named_parameters()}
                    return step(*args, **kwargs)

                model.step = recording_step
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.micro_losses.append(float(loss))  # divided by the accumulation: a step's loss is the sum
            return loss

        def step_losses(self) -> list[float]:
            m = self.micro_losses
            return [m[i] + m[i + 1] for i in range(0, len(m), 2)]

    return Recording


def _launched(rank: int, world: int) -> None:
    """What a launcher sets; the process group exists already (tests/distributed.py)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")


def _logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry and "train_runtime" not in entry]


def _assert_as_reference(losses: list[float], grads: dict[str, torch.Tensor], reference: dict, where: str) -> None:
    """Each step's loss and every parameter's gradient equal the reference run's (the project's tolerances)."""
    assert losses == pytest.approx(reference["losses"], rel=LOSS_REL, abs=0), f"{losses}: {where}"
    assert sorted(grads) == sorted(reference["grads"]), where
    for name, grad in grads.items():
        torch.testing.assert_close(
            grad, reference["grads"][name], **GRAD_TOL, msg=lambda m, n=name: f"grad {n} {where}: {m}"
        )


def _reference(rank: int, world: int, out: str) -> None:
    """The one-process Trainer (ZeRO-2), and the Trainer-level refusals."""
    _launched(rank, world)
    Recording = _recording_trainer()
    model = _model()
    ds_config = _ds_config(2, 1, 1)
    with pytest.raises(ValueError, match=r"^TrainingArguments\(activation_checkpointing=True\) .*\"layers\"") as e:
        Recording(model=_model(), args=_args(f"{out}/refused", ds_config, gradient_checkpointing=True))
    assert "\n" not in str(e.value)
    trainer = Recording(model=model, args=_args(f"{out}/reference", ds_config), train_dataset=_rows())
    # No sequence length: the "auto" keep_attention counts as off, and the printed line says how to decide it.
    assert len(trainer.plan.notes) == 1 and "seqlen=" in trainer.plan.notes[0], trainer.plan.notes
    assert trainer.plan.mtraining.activation_checkpointing.keep_attention is False
    trainer.train()
    density = _logged(trainer, "attention_density")
    assert len(density) == 3 and all(0 < d <= 1 for d in density), density
    assert _logged(trainer, "loss") == pytest.approx(trainer.step_losses(), rel=1e-6)
    evaluated = trainer.evaluate(eval_dataset=_rows()[:2])["eval_loss"]
    torch.save(
        {"losses": trainer.step_losses(), "grads": trainer.grads, "density": density, "eval": evaluated},
        f"{out}/reference.pt",
    )


def _parallel(rank: int, world: int, out: str) -> None:
    """Every case of :data:`CASES` in turn; then, after the ZeRO-3 ring run, the resume and ``save_model``."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param

    _launched(rank, world)
    Recording = _recording_trainer()
    reference = torch.load(f"{out}/reference.pt")
    for stage, ulysses, ring in CASES:
        where = f"rank {rank}, ZeRO-{stage}, Ulysses {ulysses} x ring {ring}"
        resumable = (stage, ring) == (3, 2)
        run = f"{out}/zero{stage}-u{ulysses}-r{ring}"
        save = {"save_strategy": "steps", "save_steps": 2} if resumable else {}
        trainer = Recording(model=_model(), args=_args(run, _ds_config(stage, ulysses, ring), **save),
                            train_dataset=_rows())  # fmt: skip
        assert trainer.mesh.shape.sp == 2 and trainer.get_total_train_batch_size(trainer.args) == 2, where
        assert trainer.data_collator(_rows()[:1])["input_ids"].shape == (1, N // 2), where  # this rank's shard
        trainer.train()
        losses = trainer.step_losses()
        _assert_as_reference(losses, trainer.grads, reference, where)
        assert _logged(trainer, "loss") == pytest.approx(losses, rel=1e-6), where
        density = _logged(trainer, "attention_density")
        assert density == pytest.approx(reference["density"], abs=1e-6), f"{density}: {where}"
        evaluated = trainer.evaluate(eval_dataset=_rows()[:2])["eval_loss"]  # the whole sequences' loss too
        assert evaluated == pytest.approx(reference["eval"], rel=LOSS_REL), f"eval loss {evaluated}: {where}"
        if not resumable:
            continue
        # save_model: a folder plain transformers loads (its own attention), the stretch kept, the weights trained.
        trainer.save_model(f"{run}/final")
        weights = {n: safe_get_full_fp32_param(p) for n, p in trainer.model_wrapped.module.named_parameters()}
        if rank == 0:
            from transformers import AutoModelForCausalLM
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()  # plain transformers: not built partitioned under the run's ZeRO-3 config
            loaded = AutoModelForCausalLM.from_pretrained(f"{run}/final")
            assert loaded.config.rope_parameters["rope_type"] == "linear", loaded.config.rope_parameters
            assert loaded.config.rope_parameters["factor"] == 2.0 and loaded.config.max_position_embeddings == 1024
            assert loaded.config._attn_implementation != "mtraining"
            state = dict(loaded.named_parameters())
            assert sorted(state) == sorted(weights), where
            for name, weight in weights.items():
                torch.testing.assert_close(state[name], weight, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
        dist.barrier()
        # resume_from_checkpoint: a new Trainer from step 2's checkpoint trains step 3 to the same loss.
        resumed = Recording(model=_model(), args=_args(run, _ds_config(stage, ulysses, ring)), train_dataset=_rows())
        resumed.train(resume_from_checkpoint=f"{run}/checkpoint-2")
        assert resumed.step_losses() == pytest.approx(losses[2:], rel=1e-6, abs=0), where


def _documents(rank: int, world: int, out: str) -> None:
    """Packed documents under ``document_masking``: one process, then (world 2) ring 2 and Ulysses 2 under ZeRO-2,
    each against the one process's losses and gradients (saved by the world of one)."""
    from ds_mtraining.integration.hf_trainer import BATCH_KEY

    _launched(rank, world)
    Recording = _recording_trainer()
    cases = [(1, 1)] if world == 1 else [(1, 2), (2, 1)]
    for ulysses, ring in cases:
        where = f"rank {rank}, documents, Ulysses {ulysses} x ring {ring}"
        trainer = Recording(model=_model(), args=_args(f"{out}/docs-u{ulysses}-r{ring}",
                                                       _ds_config(2, ulysses, ring, documents=True)),
                            train_dataset=_packed_rows())  # fmt: skip
        batch = trainer.data_collator(_packed_rows()[:1])[BATCH_KEY]
        assert batch.documents is not None, where  # the restarting positions reached the attention
        trainer.train()
        losses = trainer.step_losses()
        if world == 1:
            # The masking acts: the same rows as one causal sequence each train to other losses.
            whole = Recording(model=_model(), args=_args(f"{out}/no-docs", _ds_config(2, 1, 1)),
                              train_dataset=_packed_rows())  # fmt: skip
            whole.train()
            assert all(abs(a - b) > 1e-4 for a, b in zip(losses, whole.step_losses())), (losses, whole.step_losses())
            torch.save({"losses": losses, "grads": trainer.grads}, f"{out}/docs-reference.pt")
            continue
        reference = torch.load(f"{out}/docs-reference.pt")
        _assert_as_reference(losses, trainer.grads, reference, where)


def _hierarchical(rank: int, world: int, out: str) -> None:
    """A ring of 4 as 2 nodes of 2 (``inner_ring_size``), K/V passed around the inner ring and all-gathered in it:
    the one process's losses and gradients (the ``reference`` fixture's)."""
    _launched(rank, world)
    Recording = _recording_trainer()
    reference = torch.load(f"{out}/reference.pt")
    for exchange in ("ring", "all_gather"):
        where = f"rank {rank}, ring 4 as 2 x 2, K/V {exchange}"
        trainer = Recording(model=_model(), args=_args(f"{out}/hier-{exchange}", _ds_config(
            2, 1, 4, inner_ring_size=2, kv_exchange=exchange)), train_dataset=_rows())  # fmt: skip
        assert trainer.mesh.shape.ring == 4 and trainer.mesh.shape.inner_ring == 2, where
        trainer.train()
        losses = trainer.step_losses()
        _assert_as_reference(losses, trainer.grads, reference, where)


DP_CASES = [(2, 1, 2), (3, 2, 1)]  # (ZeRO stage, ulysses, ring) on 4 processes: 2 data-parallel groups


def _data_parallel_reference(rank: int, world: int, out: str) -> None:
    """One process, two rows a micro-batch: what 2 data-parallel sequence groups of one row each train."""
    _launched(rank, world)
    Recording = _recording_trainer()
    trainer = Recording(model=_model(), args=_args(f"{out}/dp-reference", _ds_config(2, 1, 1),
                                                   per_device_train_batch_size=2),
                        train_dataset=_rows(2 * ROWS))  # fmt: skip
    trainer.train()
    torch.save({"losses": trainer.step_losses(), "grads": trainer.grads}, f"{out}/dp-reference.pt")


def _data_parallel(rank: int, world: int, out: str) -> None:
    """:data:`DP_CASES` on 4 processes: each sequence group reads its own rows (the loader sharded over the
    data-parallel ranks only) and the step's loss and gradients are the one process's over both groups' rows."""
    _launched(rank, world)
    Recording = _recording_trainer()
    reference = torch.load(f"{out}/dp-reference.pt")
    for stage, ulysses, ring in DP_CASES:
        where = f"rank {rank}, ZeRO-{stage}, 2 groups of Ulysses {ulysses} x ring {ring}"
        trainer = Recording(model=_model(), args=_args(f"{out}/dp-zero{stage}-u{ulysses}-r{ring}",
                                                       _ds_config(stage, ulysses, ring)),
                            train_dataset=_rows(2 * ROWS))  # fmt: skip
        assert trainer.mesh.shape.dp == 2 and trainer.mesh.shape.sp == 2, where
        assert trainer.get_total_train_batch_size(trainer.args) == 4, where  # 1 row x accumulation 2 x 2 groups
        trainer.train()
        losses = _logged(trainer, "loss")  # the mean over the groups, as the Trainer logs it
        _assert_as_reference(losses, trainer.grads, reference, where)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("hf_trainer"))
    run_distributed(1, _reference, out, timeout=120)
    return out


def test_two_processes_match_one_process_and_resume(reference):
    """Ulysses 2 and ring 2, ZeRO-2 and ZeRO-3: the one process's losses and gradients; the ZeRO-3 ring run's
    checkpoint resumes to the same loss, and its save_model folder loads in plain transformers."""
    run_distributed(2, _parallel, reference, timeout=300)


def test_data_parallel_sequence_groups_match_one_process(tmp_path):
    """Two data-parallel groups of 2 sequence ranks (ring under ZeRO-2, Ulysses under ZeRO-3): the loss and every
    gradient of one process training both groups' rows in one micro-batch."""
    run_distributed(1, _data_parallel_reference, str(tmp_path), timeout=120)
    run_distributed(4, _data_parallel, str(tmp_path), timeout=400)


def _refusal(**change):
    """``plan_trainer``'s inputs for a world of 2, with ``change`` applied."""
    config = _ds_config(2, 2, 1)
    inputs = {"deepspeed": config, "model": _model(), "world": 2}
    return inputs | change


@pytest.mark.parametrize(
    "change,message",
    [
        pytest.param(
            {"world": 3}, r"^world size 3 is not a multiple of sequence_parallel_size=2 .*change the degrees$",
            id="degrees",
        ),
        pytest.param(
            {"deepspeed": {k: v for k, v in _ds_config(2, 1, 1).items() if k != "mtraining"}},
            r'^DeepSpeed config <dict> has no "mtraining" section, .*ds_configs/zero2.json$',
            id="no-section",
        ),
        pytest.param({"deepspeed": None}, r"^MTrainingTrainer needs TrainingArguments\(deepspeed=\.\.\.\)", id="none"),
        pytest.param(
            {"model": "sdpa"}, r"^Qwen2ForCausalLM runs attn_implementation='sdpa', not \"mtraining\": build it with",
            id="attention",
        ),
        pytest.param(
            {"model": "head-dim-32"}, r"^Qwen2ForCausalLM: a head dim the kernels lack \(head_dim=32\) .*64 or 128$",
            id="unsupported-model",
        ),
    ],
)
def test_bad_inputs_are_one_line(change, message):
    from ds_mtraining.integration.hf_trainer import plan_trainer

    if change.get("model") == "sdpa":
        change = {"model": _model(attention="sdpa")}
    elif change.get("model") == "head-dim-32":
        config = _tiny_config()
        config.hidden_size = 64
        change = {"model": _model(config)}
    with pytest.raises(ValueError, match=message) as e:
        plan_trainer(**_refusal(**change))
    assert "\n" not in str(e.value)


def test_without_a_length_auto_memory_settings_count_as_off_in_one_line():
    """No ``seqlen``: ``"auto"`` of ``keep_attention`` and of the MLP's tile run as off, and the plan's one note
    says so and how to have them decided; values written are kept, and then nothing is said."""
    from ds_mtraining.integration.hf_trainer import plan_trainer

    config = _ds_config(2, 1, 1)
    config["mtraining"] |= {"tiled_mlp": {"tokens_per_tile": "auto"}}
    p = plan_trainer(config, _model(), world=1)
    assert p.mtraining.activation_checkpointing.keep_attention is False
    assert p.mtraining.tiled_mlp.tokens_per_tile is None
    assert len(p.notes) == 1 and "\n" not in p.notes[0]
    assert p.notes[0].startswith('memory    activation_checkpointing.keep_attention and tiled_mlp.tokens_per_tile '
                                 '"auto" count as off here'), p.notes  # fmt: skip
    assert "MTrainingTrainer(..., seqlen=N)" in p.notes[0] and "SFTConfig(max_length=N)" in p.notes[0]
    written = _ds_config(2, 1, 1)
    written["mtraining"] |= {"activation_checkpointing": {"keep_attention": True},
                             "tiled_mlp": {"tokens_per_tile": 2048}}  # fmt: skip
    p = plan_trainer(written, _model(), world=1)
    assert p.notes == () and p.mtraining.activation_checkpointing.keep_attention is True
    assert p.mtraining.tiled_mlp.tokens_per_tile == 2048


@pytest.fixture
def routes(tmp_path, monkeypatch, capsys):
    """``(job, trainer)``: each a function of a ``memory.Machine`` (``memory.this_machine``, which both reach
    through ``memory.plan_memory``) giving its route's plan of Qwen2.5-3B (yarn x16) at 128K on
    ``ds_configs/zero2_offload.json``: the job's (``training.plan.plan``) with the lines it printed, and the Trainer
    route's (``plan_trainer`` with ``seqlen``, the model built on the meta device)."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    import ds_mtraining
    from ds_mtraining import memory
    from ds_mtraining.integration.hf_trainer import plan_trainer
    from ds_mtraining.training.plan import plan, plan_model
    from ds_mtraining.training.settings import TrainSettings

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    path = "ds_configs/zero2_offload.json"
    settings = TrainSettings(deepspeed=path, model="model_configs/qwen2.5-3b", rope_kind="yarn", rope_factor=16.0,
                             seqlen=131072, steps=2, no_save=True, output_dir=str(tmp_path / "job"))  # fmt: skip
    unset_hf_deepspeed_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(plan_model(settings).config, attn_implementation="mtraining")
    filled, _, _ = ds_mtraining.deepspeed_config(path, settings.steps)  # as the example's Trainer fills "auto"

    def job(machine: memory.Machine):
        monkeypatch.setattr(memory, "this_machine", lambda: machine)
        capsys.readouterr()
        decided = plan(settings)
        return decided, tuple(capsys.readouterr().out.splitlines())

    def trainer(machine: memory.Machine):
        monkeypatch.setattr(memory, "this_machine", lambda: machine)
        return plan_trainer(path, model, world=1, seqlen=settings.seqlen, micro_batch=1, filled=filled)

    return job, trainer


def _peak(kept: int) -> int:
    """The estimated GPU peak of the ``routes`` run (fp32: bf16 "auto" is off on the CPU) with the attention kept in
    ``kept`` layers."""
    from transformers import AutoConfig

    from ds_mtraining.memory import estimate_memory

    config = AutoConfig.from_pretrained("model_configs/qwen2.5-3b")
    return estimate_memory(config, params=3_085_938_688, zero_stage=2, dp=1, offload=True, tokens=131072,
                           dtype_bytes=4, kept_attention_layers=kept).total  # fmt: skip


def test_with_a_length_the_trainer_decides_auto_memory_settings_as_the_job(routes):
    """``plan_trainer(..., seqlen=)`` decides ``keep_attention`` ``"auto"`` by the job's memory plan on the same
    machine: kept (in the 35 sparse layers of 36) where the step fits with it, recomputed where it fits only without
    it, and refused with the job's message where nothing fits; the decisions and the banner lines are the job's."""
    from ds_mtraining.config import ConfigError
    from ds_mtraining.memory import FILL, Machine

    job, trainer = routes
    ram = 2 * 2**40
    unkept, kept = _peak(0), _peak(35)
    roomy = Machine(device_bytes=int(2 * kept / FILL), host_bytes=ram, ranks_per_host=1)
    tight = Machine(device_bytes=int((unkept + kept) / 2 / FILL), host_bytes=ram, ranks_per_host=1)
    for machine, keep in ((roomy, True), (tight, False)):
        planned, printed = job(machine)
        decided = trainer(machine)
        assert planned.mtraining.activation_checkpointing.keep_attention is keep
        assert decided.mtraining == planned.mtraining
        assert decided.mtraining.tiled_mlp.tokens_per_tile is None  # the JSON's (not "auto")
        assert decided.notes == printed, (decided.notes, printed)
        assert any(f"keep_attention auto: {'kept in 35 sparse layers' if keep else 'not kept'}" in n
                   for n in decided.notes), decided.notes  # fmt: skip
    small = Machine(device_bytes=unkept // 4, host_bytes=ram, ranks_per_host=1)
    with pytest.raises(ConfigError) as refused_job:
        job(small)
    with pytest.raises(ConfigError) as refused_trainer:
        trainer(small)
    assert str(refused_trainer.value) == str(refused_job.value)
    assert str(refused_job.value).startswith("ds_configs/zero2_offload.json: a rank needs about"), refused_job.value


def _collate(features: list[dict], *, ring: int = 1, rank: int = 0, masking: bool = False):
    """``MeshCollator`` around ``default_data_collator`` for ``rank`` of a ring of ``ring`` (no process group)."""
    from transformers.data.data_collator import default_data_collator

    from ds_mtraining.config import MTrainingConfig
    from ds_mtraining.integration.hf_trainer import MeshCollator
    from ds_mtraining.parallel.mesh import MeshCoordinates
    from ds_mtraining.parallel.mesh import MeshShape

    shape = MeshShape.build(world=ring, ulysses=1, ring=ring, q_heads=2, kv_heads=2)
    mtraining = MTrainingConfig.model_validate({"data": {"document_masking": masking}})
    _, ring_rank, ulysses_rank = shape.coords(rank)
    return MeshCollator(default_data_collator, mtraining, MeshCoordinates(shape, ring_rank, ulysses_rank), pad_id=0)(
        features
    )


def test_collator_keeps_the_callers_labels_documents_and_right_padding():
    """What ``MeshCollator`` reads from the Trainer's collator, reassembled over a ring of 2 by global position:
    the caller's ``-100`` labels shifted with the tokens, packed documents from restarting position ids (no label
    across a boundary, positions restarting), right padding without labels; padding on the left is one line."""
    from ds_mtraining.integration.hf_trainer import BATCH_KEY

    n = 200  # the striped layout pads it to 256 over 2 ranks
    ids = torch.arange(n) % 50 + 3
    labels = ids.clone()
    labels[:20] = -100  # a prompt: no loss on it
    positions = torch.cat([torch.arange(120), torch.arange(80)])  # two packed documents
    mask = (torch.arange(n) < 190).long()  # right padding: the last 10 tokens
    feature = {"input_ids": ids, "labels": labels, "position_ids": positions, "attention_mask": mask}
    got_labels, got_positions = torch.full((256,), -7), torch.full((256,), -7)
    counts = set()
    for rank in (0, 1):
        batch = _collate([feature], ring=2, rank=rank, masking=True)[BATCH_KEY]
        index = batch.layout.positions(rank)
        got_labels[index], got_positions[index] = batch.labels[0], batch.position_ids[0]
        counts.add(batch.label_tokens)
    expected = torch.full((256,), -100)
    expected[: n - 1] = labels[1:]
    expected[119] = -100  # the first document's last token: its next token is the second document's
    expected[189:] = -100  # the last real token's target and the padding
    assert torch.equal(got_labels, expected)
    assert counts == {int((expected != -100).sum())}
    assert torch.equal(got_positions[:n], positions) and (got_positions[n:] > 79).all()

    left = feature | {"attention_mask": (torch.arange(n) >= 10).long()}
    with pytest.raises(ValueError, match=r"^attention_mask pads inside or before a row's tokens; .*right") as e:
        _collate([left])
    assert "\n" not in str(e.value)


def test_engine_config_and_trainer_arguments_follow_the_mesh_and_the_json():
    """The engine's batch size counts the data-parallel ranks only and ZeRO-3 gathers the weights for save_model;
    the Trainer's arguments are the JSON's (a constant rate where it has no scheduler, as DeepSpeed runs it)."""
    from ds_mtraining.integration.hf_trainer import _fit_config, trainer_arguments

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "train_batch_size": 24,
              "zero_optimization": {"stage": 3}}  # fmt: skip
    _fit_config(config, dp=2)  # accelerate's fill counted the world (4 processes), not DP
    assert config["train_batch_size"] == 12
    assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    kept = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}}
    _fit_config(kept, dp=1)
    assert kept["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is False

    arguments = trainer_arguments(_ds_config(2, 1, 1) | {"gradient_clipping": 0.5, "bf16": {"enabled": False}})
    assert arguments == {"max_grad_norm": 0.5, "bf16": False, "lr_scheduler_type": "constant"}


@pytest.mark.parametrize(
    "script,flags",
    [
        pytest.param("hf_trainer.py", ["--ulysses-degree", "2"], id="trainer-ulysses2"),
        pytest.param("trl_sft.py", ["--ring-degree", "2"], id="trl-ring2"),
    ],
)
def test_example_runs_under_torchrun(tmp_path, script, flags):
    """The examples as users launch them (``torchrun --nproc_per_node 2``), one step, on the shipped ZeRO-2 JSON;
    the saved model loads in plain transformers. The TRL one needs the ``hf`` extra."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    if script == "trl_sft.py":
        pytest.importorskip("trl")
    repo = Path(__file__).resolve().parents[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher} | {"OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               str(repo / "examples" / script), "--deepspeed", str(repo / "ds_configs" / "zero2.json"),
               "--steps", "1", "--seqlen", "256", "--output-dir", str(tmp_path / "run"), *flags]  # fmt: skip
    run = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "step 1" in run.stdout, run.stdout[-3000:]
    assert "count as off" not in run.stdout  # each example gives the Trainer its length (TRL: SFTConfig.max_length)
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final").config.model_type == "qwen2"


def test_packed_documents_over_sequence_ranks_match_one_process(tmp_path):
    """Rows of three packed documents (restarting position ids, ``document_masking``): ring 2 and Ulysses 2 give
    the one process's losses and every gradient."""
    run_distributed(1, _documents, str(tmp_path), timeout=120)
    run_distributed(2, _documents, str(tmp_path), timeout=300)


def test_hierarchical_ring_matches_one_process(reference):
    """Ring 4 as 2 nodes of 2 (inner ring, K/V passed or all-gathered): the one process's losses and gradients."""
    run_distributed(4, _hierarchical, reference, timeout=400)
