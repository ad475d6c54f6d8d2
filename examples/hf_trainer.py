"""Train with the sparse attention and the sequence-parallel mesh from a plain ``transformers.Trainer`` script.

    deepspeed --num_gpus 2 examples/hf_trainer.py --deepspeed ds_configs/zero2.json --ulysses-degree 2
    torchrun --nproc_per_node 2 examples/hf_trainer.py --deepspeed ds_configs/zero2.json --ring-degree 2
    python examples/hf_trainer.py --deepspeed ds_configs/zero2.json            # one process, seconds on a CPU

Everything the training job (``launch/train.py``) does to a step comes from ``ds_mtraining.integration.hf_trainer``:
the model is an ordinary transformers causal LM built with ``attn_implementation="mtraining"``, the DeepSpeed JSON
with its ``"mtraining"`` section goes to ``TrainingArguments(deepspeed=...)``, and ``MTrainingTrainer`` (a
``transformers.Trainer``) builds the mesh, lays out and shards each batch, passes the attention handle to every
forward and computes the tiled loss. Checkpoints, resume and the final model are the Trainer's own
(``--save-steps``, ``--resume``, ``save_model`` into ``OUTPUT_DIR/final``, which plain transformers loads).

By default it trains ``tiny-qwen2`` (random init) on the job's synthetic long-range copies at 512 tokens for 2
steps; ``--model`` and ``--data`` take what the job's flags take (a Hugging Face folder, ``model_configs/...``,
``smollm2-135m``; packed rows from ``launch/prepare_data.py``), ``--rope-kind``/``--rope-factor`` stretch the
model's context. ``--ulysses-degree`` / ``--ring-degree`` replace the JSON's degrees (the shipped JSONs have none).
The JSON's ``"auto"`` values are decided as the job decides them (bf16 by the GPU, the schedule by ``--steps``,
``keep_attention`` and the MLP's tile by the GPU memory plan at ``--seqlen``), and the Trainer's arguments are set
to match the JSON (``trainer_arguments``). Without a GPU the optimizer is torch's AdamW: DeepSpeed's own would be
compiled first (minutes).

The last line is the throughput, as the job reports it (tokens/s, the mean over the steps after the first); world
process zero also writes it to ``OUTPUT_DIR/throughput.json``: ``{"tokens_per_s", "steps_timed", "seconds"}``
(``seconds``: each timed step's; ``tokens_per_s`` ``null`` where no step ran), which
``benchmarks/trainer_route.py`` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed", required=True, help='DeepSpeed JSON with an "mtraining" section')
    parser.add_argument("--model", default="tiny-qwen2", help="tiny-qwen2, smollm2-135m, a folder or a config JSON")
    parser.add_argument("--data", help="packed rows from launch/prepare_data.py (default: as the job chooses)")
    parser.add_argument("--seqlen", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps")
    parser.add_argument("--ulysses-degree", type=int, help="replace the JSON's mtraining.parallel.ulysses_degree")
    parser.add_argument("--ring-degree", type=int, help="replace the JSON's mtraining.parallel.ring_degree")
    parser.add_argument("--rope-kind", choices=["linear", "yarn", "ntk"], help="RoPE scaling past the trained context")
    parser.add_argument("--rope-factor", type=float, default=2.0, help="new context / trained context")
    parser.add_argument("--output-dir", default="runs/hf_trainer", help="checkpoints, logs and the final model")
    parser.add_argument("--save-steps", type=int, default=0, help="a Trainer checkpoint every N steps (0: none)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output-dir")
    parser.add_argument("--seed", type=int, default=0, help="model init and data seed")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return parser.parse_args(argv)


class Rows(torch.utils.data.Dataset):
    """The job's training rows (``training.data.build_data``) as a map-style dataset: ``{"input_ids"}`` per row, and
    under ``document_masking`` the packed documents as restarting ``position_ids`` (what ``MeshCollator`` reads)."""

    def __init__(self, data, count: int, documents: bool) -> None:
        self.data, self.count, self.documents = data, count, documents

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        from ds_mtraining.data.packing import position_ids

        row = {"input_ids": self.data.batch([i])[0]}
        if self.documents:
            row["position_ids"] = position_ids(self.data.documents([i])[0])
        return row


class StepClock:
    """A ``TrainerCallback`` timing each optimizer step (the device synchronised at both ends), for tokens/s as the
    job reports it."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def _now(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self._start = self._now()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.seconds.append(self._now() - self._start)

    def __getattr__(self, name: str):
        if name.startswith("on_"):  # the Trainer calls every event on every callback; the others do nothing
            return lambda *args, **kwargs: None
        raise AttributeError(name)


def main(argv: list[str] | None = None) -> None:
    from transformers import TrainingArguments

    import ds_mtraining
    from ds_mtraining.integration.fused_kernels import use_fused_kernels
    from ds_mtraining.integration.hf_trainer import MTrainingTrainer, trainer_arguments
    from ds_mtraining.training.data import build_data
    from ds_mtraining.training.plan import plan_model
    from ds_mtraining.training.settings import TrainSettings

    args = parse_args(argv)
    # The JSON's "auto" values decided as launch/train.py decides them, and its "mtraining" section checked.
    ds_config, mtraining, notes = ds_mtraining.deepspeed_config(args.deepspeed, args.steps)
    parallel = dict(ds_config["mtraining"].get("parallel", {}))
    ulysses = args.ulysses_degree or parallel.get("ulysses_degree", 1)
    ring = args.ring_degree or parallel.get("ring_degree", 1)
    parallel.update(ulysses_degree=ulysses, ring_degree=ring, sequence_parallel_size=ulysses * ring)
    ds_config["mtraining"] = ds_config["mtraining"] | {"parallel": parallel}
    schedule = ds_config.get("scheduler", {}).get("params", {})
    if "total_num_steps" in schedule:  # the Trainer checks that the schedule spans its max_steps (the job: at least)
        schedule["total_num_steps"] = args.steps
    if not torch.cuda.is_available() and ds_config.get("optimizer", {}).get("type", "").lower() in ("adam", "adamw"):
        ds_config["optimizer"]["params"]["torch_adam"] = True  # DeepSpeed's CPU Adam: a JIT build of minutes

    settings = TrainSettings(
        deepspeed=args.deepspeed, model=args.model, data=args.data, seqlen=args.seqlen, steps=args.steps,
        rope_kind=args.rope_kind, rope_factor=args.rope_factor, output_dir=args.output_dir, seed=args.seed,
    )  # fmt: skip
    spec = plan_model(settings)  # the job's checks: what the attention serves, the length within the context
    data = build_data(settings, spec)
    micro = int(ds_config.get("train_micro_batch_size_per_gpu", 1))
    accumulation = int(ds_config.get("gradient_accumulation_steps", 1))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rows = Rows(data, args.steps * micro * accumulation * max(1, world // (ulysses * ring)),
                documents=mtraining.data.document_masking)  # fmt: skip

    training = TrainingArguments(
        args.output_dir, deepspeed=ds_config, max_steps=args.steps, logging_steps=1, seed=args.seed,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500, report_to=[],
        use_cpu=not torch.cuda.is_available(), dataloader_drop_last=True, disable_tqdm=True,
        **trainer_arguments(ds_config),
    )  # fmt: skip
    # Liger's fused classes (on a GPU, "fused_kernels": "auto") must be in place when the model is built.
    with use_fused_kernels(spec.config, mtraining.fused_kernels.enabled) as fused:
        model = spec.build(seed=args.seed)
        clock = StepClock()
        # seqlen: the memory plan decides "auto" of keep_attention and the MLP's tile as the job does.
        trainer = MTrainingTrainer(
            model=model, args=training, train_dataset=rows, callbacks=[clock], seqlen=args.seqlen
        )
        if trainer.is_world_process_zero():
            print(f"{spec.name}: {trainer.plan.shape.describe()}, {args.seqlen} tokens; {notes[0]}; {fused}")
        start = time.perf_counter()
        trainer.train(resume_from_checkpoint=True if args.resume else None)
        seconds = time.perf_counter() - start
        trainer.save_model(os.path.join(args.output_dir, "final"))
    if trainer.is_world_process_zero():
        tokens = micro * accumulation * trainer.plan.shape.dp * args.seqlen  # per optimizer step
        timed = clock.seconds[1:] or clock.seconds  # the first step also compiles kernels and warms the allocator
        tokens_per_s = tokens * len(timed) / sum(timed) if timed else None
        with open(os.path.join(args.output_dir, "throughput.json"), "w") as f:
            json.dump({"tokens_per_s": tokens_per_s, "steps_timed": len(timed), "seconds": timed}, f)
        rate = "no step run" if tokens_per_s is None else f"{tokens_per_s:,.0f} tokens/s"
        print(f"step {trainer.state.global_step}: {rate} (mean over steps after the first); {seconds:.1f} s in "
              f"train(); model in {os.path.join(args.output_dir, 'final')}")  # fmt: skip

if __name__ == "__main__":
    main()
