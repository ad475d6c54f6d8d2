"""Triton kernels of the spread estimator (CUDA; CPU only under ``TRITON_INTERPRET=1``), loaded through
``estimator.kernels``: ``evidence`` (row statistics, evidence and candidates' attention sweeps over the keys),
``candidates`` (the candidate columns' ratio), ``greedy`` (the greedy's rounds), ``tail`` (the tail repair's
split) and ``recall`` (the report's recall). The index's own kernels (``with_columns``, ``density``) are in
``sparse.triton``."""
