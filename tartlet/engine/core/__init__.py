"""The engine's core: the engine object, the scheduler, batches, sequences, KV pages and their accounting, samplers."""
