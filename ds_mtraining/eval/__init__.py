"""Evaluation: perplexity vs context length, attention fidelity (estimator vs oracle), needle in a haystack, RULER.

Each part is a module callable from Python (``perplexity``, ``fidelity``, ``niah``, ``ruler``) and a subcommand
of ``launch/eval.py``. Models run through the training's attention, ``attn_implementation="mtraining"``
(``integration.transformers.MTrainingAttention``: dense or estimated vertical-slash sparse per layer, generation
over a KV cache, probes). Modules are imported on demand (they pull in transformers).
"""
