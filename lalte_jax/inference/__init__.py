"""Constant-memory inference: per-layer decode caches and the generation loop (§5).

caches.py       cache layouts per mixer kind (GDN, SWA ring, full attention, NSA) and ModelCache
layer_steps.py  per-mixer prefill / decode steps on the modules' own parameters
nsa_decode.py   NSA attention of one query per row at its own position
lte_cache.py    the LTE layer's ring + capped out-of-window cache (§5)
eviction.py     TOVA and uniform-stride eviction for full-attention layers (§7.1-7.2)
stack.py        prefill / decode through the scanned layer groups, logits
sampling.py     greedy / temperature / top-k / top-p
prompts.py      prompt validation, left padding, shape buckets
checkpoint.py   params-only checkpoints (orbax) for inference
cli.py          `python -m lalte_jax.generate`
The public entry is `lalte_jax.generate`.
"""
