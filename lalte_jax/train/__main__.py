"""`python -m lalte_jax.train`: the training CLI (`lalte_jax.train.cli`)."""

import sys

from lalte_jax.train.cli import main

sys.exit(main())
