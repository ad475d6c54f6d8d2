import os

import torch

# Triton kernels run through its interpreter where there is no GPU; the switch must be set before any
# kernel is defined, so it lives here rather than in a test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
