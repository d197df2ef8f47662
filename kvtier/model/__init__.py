"""One pure decoder for the Llama family and Gemma-2 (RMSNorm and Gemma's (1 + w) RMSNorm,
SwiGLU/GeGLU MLPs, RoPE with linear and llama3 scaling, fused Triton elementwise kernels on
CUDA); it calls attention through `kvtier.attention`'s interface and knows nothing of the cache.

May import: `kvtier.config`, `kvtier.attention`.
"""
