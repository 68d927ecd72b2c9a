"""lalte-jax: hybrid linear-attention language models that keep direct access to past tokens."""

from lalte_jax.config import (AttentionConfig, GDNConfig, LTEConfig, ModelConfig, NSAConfig,
                              get_model_config)

__all__ = ["AttentionConfig", "GDNConfig", "LTEConfig", "ModelConfig", "NSAConfig",
           "get_model_config"]
