"""Constant-memory inference: per-layer decode caches and the generation loop (REFERENCE_SPEC §5)."""
