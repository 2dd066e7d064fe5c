"""Attention over the page pool: one interface (:mod:`.paged_attention`) over
the C, Triton and PyTorch paths, the per-group plan (:mod:`.plan`) and the
explicit-weights path (:mod:`.explicit`)."""
