"""`python -m lalte_jax.eval ...`: see `lalte_jax.eval.cli`."""

from lalte_jax.eval.cli import main

main()
