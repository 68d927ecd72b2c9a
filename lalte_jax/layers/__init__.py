"""Building blocks shared by the mixers and the model: norms, MLP, RoPE, short conv, init, the
LM head's matmul, the LTE router's conv layer and its dropout hash."""
