"""tools/compare_torch.py without PyTorch: its configs export to the authors' format, and its
kept-token comparison notices a different kept token or count."""


import numpy as np
import pytest

from lalte_jax.convert import hf_config
from tests.tools import load_tool

compare_torch = load_tool("compare_torch")


@pytest.mark.parametrize("variant", compare_torch.VARIANTS)
@pytest.mark.parametrize("size", ["tiny", "0.4b"])
def test_case_configs_round_trip_through_the_authors_format(variant, size):
  config = compare_torch.case_config(variant, size)
  back, _ = hf_config.model_config_from_hf(hf_config.hf_config_from_model(config),
                                           name=config.name)
  assert back == config


def test_kept_token_comparison():
  rng = np.random.default_rng(0)
  counts = np.array([[[3, 2]]])  # [L_lte, B, K]
  scores = np.full((1, 1, 4, 2), -np.inf)
  scores[0, 0, :3, 0] = [np.inf, 0.2, 0.1]
  scores[0, 0, :2, 1] = rng.uniform(0, 0.5, 2)
  assert compare_torch.same_kept_tokens(scores, counts, scores.copy(), counts)[0]
  other = scores.copy()
  other[0, 0, 2, 0] = 0.3  # another token kept in the same slot
  same, message = compare_torch.same_kept_tokens(other, counts, scores, counts)
  assert not same and message.startswith("1 of 2")
  assert not compare_torch.same_kept_tokens(scores, counts - [[[0, 1]]], scores, counts)[0]
