from lalte_jax.convert.cli import main

main()
