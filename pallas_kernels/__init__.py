"""Pure array functions, one folder per op: `reference.py` (plain jnp, the ground truth), fast
versions (`pallas*.py`, and `cudnn.py` where a cuDNN kernel serves) and one public entry with an
`implementation=` argument (`dispatch.py`: the names, and each op's default in its `__init__.py`).
Shared pieces: `pallas_common.py` (helpers of every Pallas kernel), `attention_checks.py` (the
attention entries' argument checks) and `stacked.py` (decode caches stacked over layer groups).

This package never imports `lalte_jax`.
"""
