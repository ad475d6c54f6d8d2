"""Evaluation: perplexity vs context length, attention fidelity (estimator vs oracle), needle in a haystack, RULER.

Each part is a module callable from Python (``perplexity``, ``fidelity``, ``niah``, ``ruler``) and a subcommand
of ``launch/eval.py``. Models run through ``attn_implementation="mtraining_eval"`` (``eval.attention``), which
switches between dense and estimated vertical-slash sparse attention per call. Modules are imported on demand
(they pull in transformers).
"""
