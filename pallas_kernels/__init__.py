"""Pure array functions, one folder per op: `reference.py` (plain jnp, the ground truth), fast
versions (`pallas.py`, `triton.py`) and one public entry with an `implementation=` argument.

This package never imports `lalte_jax`.
"""
