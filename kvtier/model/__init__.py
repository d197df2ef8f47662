"""One pure decoder for the Llama family, Gemma-2 and DeepSeek-V2 (RMSNorm and Gemma's (1 + w)
RMSNorm, SwiGLU/GeGLU MLPs, a mixture of experts, latent attention's projections, RoPE with
linear, llama3 and YaRN scaling, fused Triton elementwise kernels on CUDA, and `fuse`: q/k/v
and gate/up as one matmul each, a transform of the built model); it calls attention through
`kvtier.attention`'s interface and knows nothing of the cache.

May import: `kvtier.config`, `kvtier.attention`.
"""
