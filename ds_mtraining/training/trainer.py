"""The training loop: one :class:`Trainer` per run, composed from the plan (:mod:`.plan`).

    plan -> process group -> mesh -> model (our attention, activation checkpointing, tiled MLP) in a DeepSpeed
    engine -> [resume] -> steps (micro-batches, metrics reduced over the world, held-out loss, checks, checkpoints,
    stops) -> summary

The engine (ZeRO stage, optimizer and its offload, accumulation, clipping, schedule) is DeepSpeed's, built from the
plan's config; the loop around it is ours because it carries what DeepSpeed's does not: the data cursor saved with
each checkpoint, the attention's per-layer statistics reduced with the loss, the stop agreed by every rank after
the same step, the non-finite guard, and the held-out loss.

The rows come from the plan's data, or from the caller (``Trainer(plan, batches=...)``: an iterable of this rank's
micro-batches of whole sequences); either way each micro-batch is checked (:func:`.data.check_rows`) and laid out
for this rank by ``integration.batch.make_batch``.

Which index a sparse layer uses is a setting of the attention handle (``indices``:
:data:`~ds_mtraining.integration.transformers.IndexSource`): estimated (training), planted (benchmarks on random
weights) or none (no attention: the ceiling of the rest of the step).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch

from ..console import make_console, track
from ..integration.budget import CAPS, RecallWatch, layer_table, sparse_layers, sparse_mean
from ..integration.deepspeed import ops_to_build
from ..integration.fused_kernels import fused_classes
from ..integration.transformers import IndexSource, MTrainingAttention
from ..notices import quiet_library_notices
from .data import Batches, Cursor, caller_rows, check_rows, plan_rows
from .distributed import init_distributed
from .finite import check_step, check_weights
from .metrics_log import Metrics
from .plan import Plan
from .settings import UsageError
from .stop import EXIT_STATUS, StopRequest

__all__ = ["Trainer"]

PHASES = ("forward", "backward", "optimizer")
"""The step's phases each record times (seconds, each ended by a device synchronisation): the micro-batches'
forwards with the loss, their backwards, and the engine's steps (the optimizer's at the accumulation boundary)."""


class Trainer(contextlib.AbstractContextManager):
    """A training run of ``plan``: joins the process group, builds the mesh, the model and its DeepSpeed engine.

    Use it as a context manager (or call :meth:`close`): the fused kernels it patches into the model's classes
    (``integration.fused_kernels``) stay in place while it runs and are restored when it closes.

    Args:
        plan: the checked inputs (:func:`~ds_mtraining.training.plan.plan`).
        batches: the caller's micro-batches (:data:`.data.Batches`) instead of the plan's data: one item per
            micro-batch of this rank, token ids ``[train_micro_batch_size_per_gpu, seqlen]`` of whole sequences
            (or with their document ids, under ``document_masking``), each data-parallel rank its own, the same on
            the ranks of a sequence-parallel group (``mesh.dp_index`` of ``mesh.shape.dp``); the Trainer shards them
            over the sequence ranks. ``fit`` draws ``steps x gradient_accumulation_steps`` of them; a resumed run
            skips the items its checkpoint trained on.
        indices: which index the sparse layers use (``"estimated"`` in training).
        stop: the run's stop request (signals); ``None``: never asked to stop.
        banner: printed by rank 0 once the process group is joined, before the engine is built (which can take
            minutes: model loading, DeepSpeed's optimizer build).

    Attributes:
        engine: the DeepSpeed engine (``engine.module`` is the transformers model).
        mesh: the process groups; ``layout``: the batches' token layout (``None`` without sequence parallelism).
        attention: the attention handle passed to every forward (its ``stats`` hold the latest forward's).
        cursor: the data sampler's position; ``step``: optimizer steps done (counting resumed ones).
    """

    def __init__(
        self,
        plan: Plan,
        *,
        batches: Batches | None = None,
        indices: IndexSource = "estimated",
        stop: StopRequest | None = None,
        banner: str = "",
    ) -> None:
        import logging

        import deepspeed

        from ..parallel.mesh import Mesh

        deepspeed.utils.logger.setLevel(logging.WARNING)  # its INFO lines (config dumps) are not the job's output
        quiet_library_notices()  # for a caller's script as for the job (whose entry point installed them first)
        self.plan = plan
        self.stop = stop
        timeout_s = plan.mtraining.parallel.timeout_s  # the deadline of every collective: world group and mesh groups
        builds = ops_to_build(plan.ds_config) if os.environ.get("RANK", "0") == "0" else []
        if builds:  # DeepSpeed compiles them silently, one after the other
            print(f"building DeepSpeed's {' and '.join(builds)} op{'s' if len(builds) > 1 else ''}: once per machine, "
                  "about a minute each on a few cores", flush=True)  # fmt: skip
        init_distributed(timeout_s, plan.mtraining.parallel.rendezvous_timeout_s)
        self.mesh = Mesh(plan.shape, timeout_s=timeout_s)
        self.console = make_console()
        if self.rank0 and banner:
            self.console.print(banner)
        self._closing = contextlib.ExitStack()
        if plan.fused.apply:  # decided by the plan; the patch before the model is built
            self._closing.enter_context(fused_classes(plan.spec.config))
        try:
            self.engine = self._build_engine()
        except BaseException:
            self.close()
            raise
        self._closing.callback(self.engine.destroy)  # its optimizer's buffers (pinned CPU memory with offload)
        self.layout = plan.layout()
        self.attention = MTrainingAttention(
            plan.mtraining.sparse_attention,
            mesh=self.mesh,
            layout=self.layout,
            ring_columns=plan.mtraining.parallel.ring_columns,
            packed=plan.mtraining.data.document_masking,
            indices=indices,
        )
        self.cursor = Cursor()
        self.step = 0
        self.resumed_from: str | None = None
        # Generators: neither reads the cursor before the first micro-batch, so a resume moves both sources.
        masking = plan.mtraining.data.document_masking
        self._rows = (
            plan_rows(lambda: self.plan.data, self.cursor, micro_batch=plan.micro_batch, dp=self.mesh.shape.dp,
                      dp_index=self.mesh.dp_index, documents=masking)
            if batches is None else caller_rows(batches, self.cursor)
        )  # fmt: skip

    @property
    def rank0(self) -> bool:
        return self.mesh.rank == 0

    def close(self) -> None:
        """Release the engine's buffers and restore what the run patched (transformers' own RMSNorm, MLP and RoPE),
        so that another ``Trainer`` can follow in the same process."""
        self._closing.close()

    def __exit__(self, *exc) -> None:
        self.close()

    def _build_engine(self):
        """The model (our attention, activation checkpointing, tiled MLP) inside a DeepSpeed engine."""
        import deepspeed

        from deepspeed.accelerator import get_accelerator

        from ..integration.checkpoint_offload import CheckpointOffload
        from ..integration.deepspeed import MeshMPU, normalize_cuda_arch_list, sum_sequence_parallel_gradients
        from ..integration.ds_config import cpu_checkpointing
        from ..integration.recompute import enable_activation_checkpointing
        from ..integration.tiled_mlp import enable_tiled_mlp

        p = self.plan
        model = p.spec.build(seed=p.settings.seed)
        checkpointing = p.mtraining.activation_checkpointing
        if checkpointing.every is not None:
            # The recomputation reuses each layer's index; with keep_attention also each sparse layer's (out, lse).
            device = get_accelerator().current_device_name()
            offload = CheckpointOffload(device) if cpu_checkpointing(p.ds_config) else None
            enable_activation_checkpointing(
                model, keep_attention=checkpointing.keep_attention, every=checkpointing.every, offload=offload
            )
        if p.mtraining.tiled_mlp.tokens_per_tile is not None:
            enable_tiled_mlp(model, p.mtraining.tiled_mlp.tokens_per_tile)
        model.train()
        normalize_cuda_arch_list()  # before DeepSpeed JIT-builds FusedAdam (a config without CPU offload)
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=p.ds_config, mpu=MeshMPU(self.mesh)
        )
        sum_sequence_parallel_gradients(engine)
        return engine

    def resume(self) -> list[str]:
        """Continue from the latest checkpoint (weights, optimizer, schedule, data cursor, step); returns the lines
        that note settings changed since it was saved (sparse budgets, learning rate)."""
        checkpoints = self.plan.checkpoints
        state = checkpoints.load(self.engine)
        # In place: the row source (plan_rows / caller_rows) holds this cursor.
        self.cursor.next_micro, self.step = int(state["data"]["next_micro"]), int(state["step"])
        self.resumed_from = checkpoints.latest_tag()
        return [f"resumed   {checkpoints.directory}/{self.resumed_from} at step {self.step}", *checkpoints.notes]

    def micro_batch(self, phases: dict[str, float] | None = None) -> torch.Tensor:
        """One micro-batch: this rank's next rows (the plan's or the caller's), forward with the tiled loss, backward,
        and the engine's step (the optimizer's at the accumulation boundary); returns the loss (fp64 scalar on the
        CPU). ``phases``: add the seconds of each of :data:`PHASES` to it (each phase ends with a device
        synchronisation). Raises ``UsageError`` (one line) for a caller's batch it cannot train on, or when the
        caller's batches have run out."""
        from ..integration.batch import make_batch
        from ..integration.loss import forward_loss

        p = self.plan
        rows = next(self._rows, None)
        if rows is None:
            needed = p.settings.steps * p.accumulation
            raise UsageError(
                f"the batches ran out after {self.cursor.next_micro} micro-batches, during step {self.step + 1}; "
                f"{p.settings.steps} steps x accumulation {p.accumulation} need {needed}"
            )
        tokens, documents = check_rows(
            rows, where=f"batch {self.cursor.next_micro - 1}", micro_batch=p.micro_batch, seqlen=p.settings.seqlen,
            vocab_size=p.spec.config.vocab_size, documents=p.mtraining.data.document_masking,
        )  # fmt: skip
        batch = make_batch(tokens, mesh=self.mesh, layout=self.layout, pad_id=p.data.pad_id, documents=documents)
        clock = _PhaseClock(phases)
        # The logits in tiles or chunks: never [N, vocab] at once.
        loss = forward_loss(self.engine, batch, self.attention, fused=p.fused.apply)
        clock.lap("forward")
        self.engine.backward(loss)
        clock.lap("backward")
        self.engine.step()
        clock.lap("optimizer")
        return loss.detach().double().cpu()

    def train_step(self) -> dict:
        """One optimizer step (``accumulation`` micro-batches): its metrics, reduced over all ranks, and under
        ``"stop"`` whether any rank was asked to stop, so that all ranks end after the same step."""
        import torch.distributed as dist

        p, mesh, engine, stats = self.plan, self.mesh, self.engine, self.attention.stats
        start = time.perf_counter()
        lr = float(engine.get_lr()[0])  # before the step: the rate this step's update uses
        phases = dict.fromkeys(PHASES, 0.0)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for _ in range(p.accumulation):
            loss_sum += self.micro_batch(phases)
        layers = sorted(stats)
        # The forward's per-layer device scalars are stacked where they are (one copy, not one host sync per value);
        # the loss and the ring imbalance (the host computes it from the index's work model) are host values. On the
        # engine's device: NCCL reduces GPU tensors only (gloo takes either).
        keys = ("density", "recall", *CAPS)
        on_device = torch.stack([getattr(stats[i], key).float() for key in keys for i in layers])
        asked = torch.tensor(float(self.stop is not None and self.stop.requested))
        on_host = torch.stack([loss_sum.float(), asked, *(stats[i].imbalance.float() for i in layers)])
        reduced = torch.cat([on_host.to(engine.device), on_device.to(engine.device)])
        dist.all_reduce(reduced)  # loss parts sum over SP; everything else is averaged below
        reduced = reduced.cpu()
        world, n = mesh.shape.world, len(layers)
        per_layer = dict(zip(("imbalance", *keys), (reduced[2:].view(-1, n) / world).tolist(), strict=True))
        seconds = time.perf_counter() - start
        tokens = p.micro_batch * p.accumulation * mesh.shape.dp * p.settings.seqlen
        self.step += 1
        return {
            "step": self.step,
            "loss": float(reduced[0]) / (mesh.shape.dp * p.accumulation),
            "lr": lr,
            "grad_norm": None if (norm := engine.get_global_grad_norm()) is None else float(norm),  # NaN stays NaN
            "tokens_per_s": tokens / seconds,
            "seconds": seconds,
            **{f"{name}_s": t for name, t in phases.items()},
            **per_layer,  # imbalance, density, recall, capped_columns, capped_offsets, capped_tail: a list per layer
            "stop": bool(reduced[1] > 0),
        }

    def heldout_loss(self) -> float:
        """The mean token loss of the plan's held-out rows under the current weights (a collective of the world)."""
        from .heldout import heldout_loss

        rows, documents = self.plan.heldout
        masking = self.plan.mtraining.data.document_masking
        return heldout_loss(self.engine, rows, self.attention, self.mesh, self.layout, self.plan.data.pad_id,
                            documents if masking else None)  # fmt: skip

    def save(self) -> str:
        """Write a checkpoint of this step (weights checked finite first); returns its tag."""
        check_weights(self.engine, self.step, self.resumed_from)
        state = {"step": self.step, "data": {"next_micro": self.cursor.next_micro}}
        return self.plan.checkpoints.save(self.engine, self.step, state)

    def fit(self) -> int:
        """Train to ``settings.steps`` with the job's outputs (progress line, ``metrics.jsonl``, ``loss.png``,
        checkpoints, summary); returns the exit status: 0, or the signal's status when stopped (a checkpoint of the
        last step written unless ``no_save``)."""
        from ..parallel import comm

        p, settings, console = self.plan, self.plan.settings, self.console
        if settings.resume:
            notes = self.resume()
            if self.rank0:
                for line in notes:
                    console.print(line, markup=False, highlight=False)
        out = Path(settings.output_dir)
        metrics = None
        if self.rank0:
            out.mkdir(parents=True, exist_ok=True)
            title = f"{out.name}: {self.plan.spec.name}, {self.plan.settings.seqlen} tokens"
            metrics = Metrics(out, self.step, title=title)
            for line in metrics.notes:
                console.print(line, markup=False, highlight=False)
        start, first, saved = time.perf_counter(), self.step, None
        sparse = p.mtraining.sparse_attention
        watch = RecallWatch(sparse)
        fields = {"loss": "-", "tok_s": "-", "density": "-", "recall": "-", "imbalance": "-"}
        with track(console, "train", settings.steps, completed=self.step, every=0, **fields) as bar:
            while self.step < settings.steps:
                comm.set_step(self.step + 1)  # named by a collective's deadline error
                record = self.train_step()
                stopping = record.pop("stop")  # any rank signalled: every rank ends after this step
                step, every = self.step, settings.heldout_every
                if p.heldout is not None and (step == settings.steps or (every and step % every == 0)):
                    record["heldout_loss"] = self.heldout_loss()
                if metrics:
                    metrics.add(record)
                    bar.advance(
                        loss=f"{record['loss']:.4f}",
                        tok_s=f"{record['tokens_per_s']:,.0f}",
                        density=f"{sparse_mean(record['density'], sparse):.3f}",
                        recall=f"{sparse_mean(record['recall'], sparse):.3f}",
                        imbalance=f"{sum(record['imbalance']) / len(record['imbalance']):.2f}",
                    )
                    for line in watch.check(record):  # once per layer and run; plain text: the fix holds [ ] and { }
                        console.print(line, markup=False, highlight=False)
                check_step(step, record["loss"], record["grad_norm"], saved or self.resumed_from)
                if p.auto is not None and self.rank0 and step - first == min(2, settings.steps - first):
                    # The second step: the first also compiles the kernels and warms the allocator.
                    if (line := p.auto.compare(record["seconds"])) is not None:
                        console.print(line, markup=False, highlight=False)
                if settings.should_save(step) or (stopping and not settings.no_save):
                    saved = self.save()
                if stopping:
                    break
        if metrics:
            metrics.plot()
            _summary(console, p, metrics.records, first, time.perf_counter() - start, saved)
        if self.step < settings.steps:  # stopped by a signal
            reason = (self.stop and self.stop.reason) or "SIGTERM"  # another rank's signal: the launcher's is SIGTERM
            if self.rank0:
                kept = f"checkpoint {saved} is latest; continue with --resume" if saved else "nothing saved (--no-save)"
                console.print(f"stopped   by {reason} after step {self.step}: {kept}")
            return EXIT_STATUS[reason]
        return 0


class _PhaseClock:
    """Adds the wall time since the previous lap to ``phases[name]``, after a device synchronisation so that the
    phase's kernels count in it; nothing (and no synchronisation) when ``phases`` is ``None``."""

    def __init__(self, phases: dict[str, float] | None) -> None:
        self.phases = phases
        self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        if self.phases is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.phases[name] += now - self.last
        self.last = now


def _summary(console, p: Plan, records: list[dict], first_step: int, wall: float, saved: str | None) -> None:
    from rich.table import Table

    settings = p.settings
    new = [r for r in records if r["step"] > first_step]
    if not new:
        console.print(f"nothing to do: the run is already at step {first_step} >= --steps {settings.steps}")
        return
    table = Table(title="training summary", show_header=False)
    table.add_row("steps", f"{first_step + 1}..{settings.steps} ({len(new)} run now)")
    table.add_row("loss", f"{new[0]['loss']:.4f} -> {new[-1]['loss']:.4f}")
    table.add_row("tokens/s", f"{sum(r['tokens_per_s'] for r in new) / len(new):,.0f} (mean)")
    sparse, last = p.mtraining.sparse_attention, new[-1]
    count = len(sparse_layers(sparse, len(last["density"])))
    over = f"mean over the {count} sparse layer{'s' if count > 1 else ''}, last step" if count else "every layer dense"
    table.add_row("attention density", f"{sparse_mean(last['density'], sparse):.3f} ({over})")
    table.add_row("observed recall", f"{sparse_mean(last['recall'], sparse):.3f}")
    table.add_row("wall time", f"{wall:.1f} s")
    out = Path(settings.output_dir)
    table.add_row(
        "outputs", f"{out / 'metrics.jsonl'}, {out / 'loss.png'}" + (f", checkpoint {saved}" if saved else "")
    )
    console.print(table)
    console.print(layer_table(last, sparse, title="attention per layer (last step)"))
