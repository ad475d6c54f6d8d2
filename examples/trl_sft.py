"""Supervised fine-tuning with TRL's ``SFTTrainer`` on the sparse attention and the sequence-parallel mesh.

    deepspeed --num_gpus 2 examples/trl_sft.py --deepspeed ds_configs/zero2.json --ring-degree 2
    torchrun --nproc_per_node 2 examples/trl_sft.py --deepspeed ds_configs/zero2.json --ulysses-degree 2
    python examples/trl_sft.py --deepspeed ds_configs/zero2.json

``class MTrainingSFTTrainer(MTrainingMixin, SFTTrainer)`` is the whole integration: TRL prepares the dataset
(tokenizes prompt/completion pairs, packs them into ``--seqlen``-token rows, masks the prompts out of the loss) and
collates padding-free rows with restarting ``position_ids``; the mixin lays each row out over the sequence ranks,
keeps every example inside its own document (``"document_masking": true``, set here), runs the sparse attention and
the tiled loss. Needs the ``hf`` extra (``pip install -e .[hf]``: TRL, Accelerate, datasets).

The data is a toy task a tiny random model can learn in a few steps: a prompt of random words and a completion that
repeats it, over a word-level tokenizer built here (``w0`` .. ``w511``; real runs pass their model's tokenizer).
TRL's own metrics (token accuracy, entropy) are not computed: the loss never builds the logits they are taken from.
"""

from __future__ import annotations

import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_trainer import StepClock, parse_args  # noqa: E402  (the sibling example: the same flags and clock)


def word_tokenizer(vocab: int):
    """A word-level tokenizer of ``vocab`` ids: ``w<i>`` is id ``i``; ``w0`` pads and is the unknown word, ``w1`` ends
    a sequence."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", pad_token="w0", eos_token="w1")


def copy_task(count: int, vocab: int, seed: int):
    """``count`` prompt/completion pairs: a prompt of 20..120 random words, the completion the same words again."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        words = [f"w{rng.randrange(2, vocab)}" for _ in range(rng.randint(20, 120))]
        rows.append({"prompt": " ".join(words), "completion": " " + " ".join(words)})
    return Dataset.from_list(rows)


def main(argv: list[str] | None = None) -> None:
    from trl import SFTConfig, SFTTrainer

    import ds_mtraining
    from ds_mtraining.integration.fused_kernels import use_fused_kernels
    from ds_mtraining.integration.hf_trainer import MTrainingMixin, trainer_arguments
    from ds_mtraining.integration.model_loading import resolve_model
    from ds_mtraining.models import RopeScaling

    class MTrainingSFTTrainer(MTrainingMixin, SFTTrainer):
        """TRL's SFTTrainer with the sparse attention and the mesh."""

    args = parse_args(argv)
    ds_config, mtraining, notes = ds_mtraining.deepspeed_config(args.deepspeed, args.steps)
    parallel = dict(ds_config["mtraining"].get("parallel", {}))
    ulysses = args.ulysses_degree or parallel.get("ulysses_degree", 1)
    ring = args.ring_degree or parallel.get("ring_degree", 1)
    parallel.update(ulysses_degree=ulysses, ring_degree=ring, sequence_parallel_size=ulysses * ring)
    # Packed examples stay apart: attention, positions and labels inside each one.
    data = dict(ds_config["mtraining"].get("data", {})) | {"document_masking": True}
    ds_config["mtraining"] = ds_config["mtraining"] | {"parallel": parallel, "data": data}
    schedule = ds_config.get("scheduler", {}).get("params", {})
    if "total_num_steps" in schedule:  # the Trainer checks that the schedule spans its max_steps
        schedule["total_num_steps"] = args.steps
    if not torch.cuda.is_available() and ds_config.get("optimizer", {}).get("type", "").lower() in ("adam", "adamw"):
        ds_config["optimizer"]["params"]["torch_adam"] = True  # DeepSpeed's CPU Adam: a JIT build of minutes

    vocab = 512
    rope = RopeScaling(kind=args.rope_kind, factor=args.rope_factor) if args.rope_kind else None
    spec = resolve_model(args.model, rope=rope, vocab_size=vocab, max_positions=max(args.seqlen, 8192))
    tokenizer = word_tokenizer(min(vocab, spec.config.vocab_size))
    config = SFTConfig(
        args.output_dir, deepspeed=ds_config, max_steps=args.steps, max_length=args.seqlen, packing=True,
        pad_to_multiple_of=args.seqlen, gradient_checkpointing=False, logging_steps=1, seed=args.seed,
        report_to=[], disable_tqdm=True,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        use_cpu=not torch.cuda.is_available(), **trainer_arguments(ds_config),
    )  # fmt: skip
    with use_fused_kernels(spec.config, mtraining.fused_kernels.enabled) as fused:
        model = spec.build(seed=args.seed)
        clock = StepClock()
        trainer = MTrainingSFTTrainer(
            model=model, args=config, train_dataset=copy_task(64 * args.steps, tokenizer.vocab_size, args.seed),
            processing_class=tokenizer, callbacks=[clock],
        )  # fmt: skip
        if trainer.is_world_process_zero():
            print(f"{spec.name}: {trainer.plan.shape.describe()}, rows of {args.seqlen} tokens; {notes[0]}; {fused}")
        start = time.perf_counter()
        trainer.train(resume_from_checkpoint=True if args.resume else None)
        seconds = time.perf_counter() - start
        trainer.save_model(os.path.join(args.output_dir, "final"))
    if trainer.is_world_process_zero():
        print(f"step {trainer.state.global_step} in {seconds:.1f} s; model in {os.path.join(args.output_dir, 'final')}")


if __name__ == "__main__":
    main()
