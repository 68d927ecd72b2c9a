"""lalte_jax.data.curricula: mixtures, staged curricula, named curricula and their config path."""

import numpy as np
import pytest

from lalte_jax.data import PasskeySource, curricula
from lalte_jax.train.config import TrainConfig
from lalte_jax.train.trainer import make_source


def test_recall_curriculum_interleaves_its_tasks_deterministically():
  mixture = curricula.recall_curriculum(seq_len=128, vocab_size=256, num_kv_pairs=4, long_gap=40,
                                        num_examples=30, seed=5)
  again = curricula.recall_curriculum(seq_len=128, vocab_size=256, num_kv_pairs=4, long_gap=40,
                                      num_examples=30, seed=5)
  assert len(mixture) == 30 and mixture.seq_len == 128
  for i in range(6):
    np.testing.assert_array_equal(mixture[i]["tokens"], again[i]["tokens"])
    np.testing.assert_array_equal(mixture[i]["tokens"],
                                  mixture.sources[i % 3][i // 3]["tokens"])
  assert isinstance(mixture.sources[2], PasskeySource)
  assert mixture.sources[1].min_gap == 40
  with pytest.raises(ValueError, match="subset"):
    curricula.recall_curriculum(seq_len=128, vocab_size=256, num_kv_pairs=4, long_gap=40,
                                num_examples=30, seed=5, tasks=("mqar", "nope"))


def test_staged_curriculum_plays_short_gap_mqar_first_then_the_mixture():
  curriculum = curricula.recall_curriculum(seq_len=128, vocab_size=256, num_kv_pairs=4,
                                           long_gap=40, num_examples=30, seed=5,
                                           warmup_examples=12)
  warmup, mixture = curriculum.stages
  assert isinstance(mixture, curricula.RecallMixture) and warmup.min_gap == 0
  assert curriculum.read_in_order and not mixture.read_in_order
  assert len(curriculum) == 30 and curriculum.seq_len == 128
  for i in range(12):
    np.testing.assert_array_equal(curriculum[i]["tokens"], warmup[i]["tokens"])
  for i in range(12, 30):
    np.testing.assert_array_equal(curriculum[i]["tokens"], mixture[i - 12]["tokens"])
  # The warm-up stream is not one of the mixture's streams.
  assert not np.array_equal(warmup[0]["tokens"], mixture.sources[0][0]["tokens"])
  with pytest.raises(IndexError):
    curriculum[30]
  with pytest.raises(ValueError, match="fewer than num_examples"):
    curricula.StagedCurriculum(curriculum.stages, (30,), 30)
  with pytest.raises(ValueError, match="one count per stage"):
    curricula.StagedCurriculum(curriculum.stages, (), 30)


def test_capacity_curriculum_mixes_loads_and_gaps_and_evaluates_long_gap():
  shape = curricula.TaskShape(seq_len=192, vocab_size=256, num_kv_pairs=10, min_gap=47,
                              prefix_len=4)
  train = curricula.curriculum_source("capacity", shape, split="train", seed=3, num_examples=9)
  assert [(s.num_kv_pairs, s.min_gap, s.prefix_len) for s in train.sources] == [
      (4, 0, 4), (10, 0, 4), (10, 47, 4)]
  assert len({s.seed for s in train.sources}) == 3
  np.testing.assert_array_equal(train[5]["tokens"], train.sources[2][1]["tokens"])
  held_out = curricula.curriculum_source("capacity", shape, split="eval", seed=4, num_examples=6)
  assert (held_out.num_kv_pairs, held_out.min_gap, held_out.prefix_len, len(held_out)) == (
      10, 47, 4, 6)
  with pytest.raises(ValueError, match="split"):
    curricula.curriculum_source("capacity", shape, split="test", seed=3, num_examples=9)


def test_train_config_selects_a_curriculum_by_name():
  config = TrainConfig(variant="gdn_swa", data="curriculum:capacity", seq_len=128,
                       mqar_num_kv_pairs=6, mqar_min_gap=47, mqar_prefix_len=4,
                       num_train_examples=12, num_eval_examples=5)
  assert config.curriculum == "capacity"
  train, held_out = make_source(config, split="train"), make_source(config, split="eval")
  assert isinstance(train, curricula.RecallMixture) and len(train) == 12
  assert [s.num_kv_pairs for s in train.sources] == [2, 6, 6]
  assert all(s.prefix_len == 4 and s.seq_len == 128 for s in train.sources)
  assert held_out.min_gap == 47 and held_out.seed == config.seed + 1 and len(held_out) == 5
  assert TrainConfig(variant="gdn_swa", data="mqar").curriculum is None
  with pytest.raises(ValueError, match=r"TrainConfig.data: 'curriculum:nope'.*capacity"):
    TrainConfig(variant="gdn_swa", data="curriculum:nope")
  with pytest.raises(ValueError, match="TrainConfig.data: 'tsv'"):
    TrainConfig(variant="gdn_swa", data="tsv")
