"""Training: config, optimizer, LTE controller, step, sharding, metrics, trainer and CLI (`python -m lalte_jax.train`)."""
