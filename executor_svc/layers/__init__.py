"""Tensor-parallel building blocks; each parameter carries a `weight_loader` for its own shard."""
