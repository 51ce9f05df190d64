"""Lowering: arguments, jax's trace, device choice, the partition plan, sharding insertion."""
