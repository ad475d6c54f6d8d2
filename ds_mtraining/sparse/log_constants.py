"""Natural-log / base-2 conversion constants of the Triton kernels (they take ``exp2`` of logits scaled by
``LOG2E`` and return log-sum-exps in natural-log units through ``LN2``)."""

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
