"""The model <-> cache interface (`Attention`, `SliceKernel`, `SliceStep`), each layer's scoring
(`spec.LayerAttention`: sliding window, soft-capping, scale) and exact attention kernels on
PyTorch SDPA (flash, or cuDNN as prefix + chunk calls merged by log-sum-exp; masked SDPA for
windows; blocked scores with an online softmax for soft-capping).

May import: `kvtier.errors`, `kvtier.config`. Imported by everything that runs attention.
"""
