"""`python -m lalte_jax.eval ...`: see `lalte_jax.eval.cli`."""

import sys

from lalte_jax.eval.cli import main

sys.exit(main())
