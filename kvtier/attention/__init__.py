"""The model <-> cache interface (`Attention`, `SliceKernel`, `SliceStep`) and exact attention
kernels on PyTorch SDPA (flash, or cuDNN as prefix + chunk calls merged by log-sum-exp).

May import: `kvtier.errors`, `kvtier.config`. Imported by everything that runs attention.
"""
