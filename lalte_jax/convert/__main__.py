"""`python -m lalte_jax.convert ...`: see `lalte_jax.convert.cli`."""

import sys

from lalte_jax.convert.cli import main

sys.exit(main())
