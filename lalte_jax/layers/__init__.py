"""Building blocks shared by the mixers and the model: norms, MLP, RoPE, short conv, init, the
LM head's matmul."""
