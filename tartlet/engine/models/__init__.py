"""The model: the decoder stack, its projections, RoPE, mixture-of-experts, the family configuration."""
