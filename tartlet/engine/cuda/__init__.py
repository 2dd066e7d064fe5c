"""CUDA paths: Triton/torch attention, RMSNorm, RoPE kernels and CUDA graphs for decode."""
