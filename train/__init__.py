"""Training entry points (the full trainer arrives with the pretraining issue)."""
