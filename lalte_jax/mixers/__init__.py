"""Token mixers, one file each: gdn, attention (full / sliding window), lte, nsa."""
