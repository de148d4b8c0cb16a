"""Training entry points on megatron-core: a small, clear loop, data, and CPU shims."""
