"""Constant-memory inference: per-layer decode caches and the generation loop (§5).

caches.py       cache layouts per mixer kind (GDN, SWA ring, full attention, NSA), ModelCache and
                the StepContext every mixer's prefill / decode reads
group_slot.py   GroupSlot: a layer group's part of a stacked cache leaf, which decode steps read
                and write in place
lte_cache.py    the LTE layer's ring + capped out-of-window cache and its operations (§5)
eviction.py     TOVA and uniform-stride eviction caches for full-attention layers (§7.1-7.2)
stack.py        prefill / decode through the scanned layer groups (Block.step), logits
sampling.py     greedy / temperature / top-k / top-p
prompts.py      prompt validation, left padding, shape buckets
checkpoint.py   params-only checkpoints (orbax) for inference
param_dtype.py  the parameters' dtype for serving: bfloat16 matrices, float32 vectors
cli.py          `python -m lalte_jax.generate`
Each mixer's prefill and decode step are methods of the mixer (`lalte_jax/mixers/`), next to its
training forward. The public entry is `lalte_jax.generate`.
"""
