"""Token mixers, one file each: gdn, attention (full / sliding window), lte, nsa. Each file holds
the mixer's training forward (`__call__`) and its inference steps over its cache (`prefill`,
`decode`)."""
