"""Evaluation suite: synthetic recall, RULER S-NIAH, perplexity, lm-eval and EVAPORATE.

- `recall`: MQAR (zoology), long-gap MQAR and passkey on the model's ids;
- `eviction_diagnostics`: capped and uncapped MQAR accuracy with what an LTE layer keeps
  (availability of the queried values, filler retention, kept counts, score gradients);
- `ruler`: S-NIAH-1/2/3 prompts in RULER's format fitted to a target length, string_match_all;
- `perplexity`: held-out perplexity and bits per byte on a prepared corpus;
- `evaporate`: the EVAPORATE tasks from local JSONL files, contains-match scoring;
- `lm_eval_adapter`: `LaLTELM`, an lm-evaluation-harness model (registered as `lalte` when
  lm_eval is installed);
- `decoding`: the model calls, all through the cached inference path (LTE cap enforced);
- `suite`, `report`, `cli`: `python -m lalte_jax.eval --checkpoint DIR --tasks ... --lengths ...`.
"""
