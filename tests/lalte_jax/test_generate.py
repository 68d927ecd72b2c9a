"""Generation (`lalte_jax.generate`): decoding reproduces the full forward pass, caches keep their
shapes, batching and padding change no greedy token, one compile per bucket, clear input errors."""

import functools
import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lalte_jax import generate as gen
from lalte_jax.config import get_model_config
from lalte_jax.inference import checkpoint, cli, sampling, stack
from lalte_jax.mixers.gdn import GatedDeltaNet
from lalte_jax.model import HybridLM
from tests import damage

TEACHER_FORCED = ["gdn", "gdn_swa", "gdn_attn", "transformer", "nsa", "lansa", "lalte"]
# Router bias giving the tiny laLTE model some kept out-of-window tokens, all within the cap.
LTE_BIAS_WITHIN_CAP = -0.08


@functools.lru_cache(maxsize=None)
def tiny_model(variant: str, init_std: float = 0.006, lte_bias: float | None = None) -> HybridLM:
  """A float32 tiny model. init_std 0.2 makes greedy outputs vary token to token (the preset's
  0.006 gives near-uniform logits whose argmax rarely changes, a weak test of decoding)."""
  config = get_model_config(f"{variant}-tiny").replace(init_std=init_std)
  model = HybridLM(config, rngs=nnx.Rngs(0))
  if lte_bias is not None:
    router = model.groups.blocks[1].mixer.router
    router.proj_bias[...] = jnp.full_like(router.proj_bias[...], lte_bias)
  return model


def relative_error(got, want):
  got, want = np.asarray(got), np.asarray(want)
  return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("variant", TEACHER_FORCED)
def test_teacher_forced_decoding_reproduces_the_forward_pass(variant):
  """Prefill 30 tokens, then feed the true tokens one by one up to T = 80: beyond every tiny window
  (SWA 48, LTE 25, NSA 32 with 16-token blocks) and the 64-token GDN chunk. Row 1 of the cache is
  left-padded by 7 and holds row 1's text, so its position t is the text's position t - 7."""
  model = tiny_model(variant, lte_bias=LTE_BIAS_WITHIN_CAP if variant == "lalte" else None)
  config = model.config
  length, prefix, pads = 80, 30, 7
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, length)).astype(np.int32)
  full, aux = nnx.jit(lambda m, t: m(t, return_aux=True))(model, jnp.asarray(tokens))
  if variant == "lalte":  # the capped cache equals the uncapped training layer only within the cap
    kept = np.asarray(aux.lte_scores > 0).sum(axis=2)  # [L_lte, B, Hkv], whole sequence
    assert 0 < kept.max() <= config.lte.cap - config.lte.num_sinks
  prompt = tokens[:, :prefix].copy()
  prompt[1] = np.concatenate([np.zeros(pads, np.int32), tokens[1, :prefix - pads]])
  valid = np.ones((2, prefix), bool)
  valid[1, :pads] = False
  cache = gen.init_cache(model, 2, max_length=length)
  logits, cache = gen.prefill(model, prompt, cache, pad_mask=valid, all_logits=True)
  assert relative_error(logits[0], full[0, :prefix]) < 1e-4
  assert relative_error(logits[1, pads:], full[1, :prefix - pads]) < 1e-4
  for t in range(prefix, length):
    step = np.asarray([tokens[0, t], tokens[1, t - pads]], np.int32)
    logits, cache = gen.decode_step(model, step, cache)
    assert relative_error(logits[0], full[0, t]) < 1e-4, f"row 0, position {t}"
    assert relative_error(logits[1], full[1, t - pads]) < 1e-4, f"row 1, position {t}"


def cache_shapes(cache):
  return jax.tree.map(lambda x: (x.shape, x.dtype), cache)


@pytest.mark.parametrize("variant,window", [("gdn_swa", 48), ("lalte", 25)])
def test_cache_is_constant_and_generation_runs_20_windows(variant, window):
  model = tiny_model(variant, init_std=0.2)
  empty = gen.init_cache(model, 2)
  assert cache_shapes(gen.init_cache(model, 2, max_length=100_000)) == cache_shapes(empty)
  # Shapes after a prefill and after a decode step, from tracing only (no compile).
  prompt = np.random.default_rng(1).integers(0, 256, (2, 9)).astype(np.int32)
  _, prefilled = jax.eval_shape(
      lambda c: stack.prefill_impl(model, jnp.asarray(prompt), jnp.ones((2, 9), bool), c, False),
      empty)
  _, decoded = jax.eval_shape(
      lambda c: stack.decode_impl(model, jnp.zeros((2,), jnp.int32), c), prefilled)
  assert cache_shapes(prefilled) == cache_shapes(empty) == cache_shapes(decoded)
  long = gen.generate(model, prompt, 20 * window)
  shorter = gen.generate(model, prompt, 11 * window)  # same new-token bucket: no new compile
  assert long.tokens.shape == (2, 20 * window)
  np.testing.assert_array_equal(long.lengths, [20 * window] * 2)
  np.testing.assert_array_equal(long.tokens[:, :11 * window], shorter.tokens)
  assert len(set(np.asarray(long.tokens[0, -window:]).tolist())) > 1  # still producing text


# laLTE (capped selection at the end of differently padded prompts) and laNSA (rows shifted so
# NSA blocks start at the first real token); the teacher-forced test checks padding everywhere.
@pytest.mark.parametrize("variant", ["lalte", "lansa"])
def test_batched_prompts_give_the_greedy_tokens_of_each_prompt_alone(variant):
  """Prompt lengths 10 and 29 fall in different buckets (16 and 32): alone, the short one has 6
  pads; in the batch, 22. laLTE runs with its default router, which keeps more than the cap."""
  model = tiny_model(variant, init_std=0.2)
  rng = np.random.default_rng(2)
  prompts = [rng.integers(0, 256, n).tolist() for n in (10, 29)]
  batch = gen.generate(model, prompts, 40)
  short_alone = gen.generate(model, prompts[:1], 40)
  np.testing.assert_array_equal(batch.tokens[0], short_alone.tokens[0])
  # The long prompt has the same 3 pads alone; next to a copy of itself it reuses the batch's
  # compile (batch 2, bucket 32) and must not see the short prompt's influence.
  long_twice = gen.generate(model, prompts[1:] * 2, 40)
  np.testing.assert_array_equal(batch.tokens[1], long_twice.tokens[0])
  assert len(set(np.asarray(batch.tokens[1]).tolist())) > 5  # outputs vary: a meaningful check


def test_one_compile_per_bucket_and_traced_sampling_parameters():
  model = tiny_model("gdn_swa", init_std=0.2)
  # Batch 2, buckets: prompt 16, new tokens 16 (the stop-token test reuses this compile).
  greedy = gen.generate(model, [[1, 2, 3, 4, 5], [6]], 9)
  before = gen.TRACE_COUNTS["generate"]  # every later call below hits the same compile
  gen.generate(model, [[7] * 14, [8] * 3], 16)
  gen.generate(model, [[1, 2, 3, 4, 5], [6]], 12, temperature=0.8, top_k=5, top_p=0.9,
               rng=jax.random.key(0), stop_tokens=[3, 4])
  top1 = gen.generate(model, [[1, 2, 3, 4, 5], [6]], 9, temperature=1.5, top_k=1,
                      rng=jax.random.key(1))
  key = jax.random.key(3)
  first = gen.generate(model, [[1, 2, 3], [4]], 9, temperature=1.0, rng=key)
  again = gen.generate(model, [[1, 2, 3], [4]], 9, temperature=1.0, rng=key)
  assert gen.TRACE_COUNTS["generate"] == before
  np.testing.assert_array_equal(top1.tokens, greedy.tokens)  # top-1 sampling is greedy
  np.testing.assert_array_equal(first.tokens, again.tokens)  # explicit keys: reproducible


def test_decode_step_fn_matches_decode_step_and_shares_its_compile():
  model = tiny_model("gdn_swa", init_std=0.2)
  tokens = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])

  def prefilled():
    return gen.prefill(model, tokens, gen.init_cache(model, 2))

  logits, cache = prefilled()
  token = jnp.argmax(logits, -1).astype(jnp.int32)
  want, _ = gen.decode_step(model, token, cache)
  got, cache = gen.decode_step_fn(model)(token, prefilled()[1])
  # Its GDN layers run their six input projections as one GEMM: float32 rounding apart.
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  before = gen.TRACE_COUNTS["decode"]
  gen.decode_step_fn(model)(token, cache)  # another step function of the model: no new compile
  assert gen.TRACE_COUNTS["decode"] == before


def test_decode_step_fn_prepares_the_model_once_outside_its_step(monkeypatch):
  """decode_step_fn fuses the GDN layers' input projections once, eagerly (not inside the jitted
  step, where every step would copy the weights again), the GPU's way too (layer groups split in
  the step, `stack.decode_groups`); its step takes no more parameter arrays than the model has
  (each argument costs host time per call), and gives decode_step's logits."""
  model = tiny_model("gdn_swa", init_std=0.2)
  tokens = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
  logits, cache = gen.prefill(model, tokens, gen.init_cache(model, 2))
  token = jnp.argmax(logits, -1).astype(jnp.int32)
  want, _ = gen.decode_step(model, token, cache)
  fused_traced = []
  fuse = GatedDeltaNet.fuse_decode_projections

  def spy(layer):
    if not layer.decode_only:
      fused_traced.append(isinstance(layer.q_proj.kernel[...], jax.core.Tracer))
    fuse(layer)

  monkeypatch.setattr(GatedDeltaNet, "fuse_decode_projections", spy)
  for decode_groups in (stack.split_groups, lambda model: None):  # the GPU's way, the CPU's
    monkeypatch.setattr(stack, "decode_groups", decode_groups)
    fused_traced.clear()
    step = gen.decode_step_fn(model)
    got, cache = step(token, gen.prefill(model, tokens, gen.init_cache(model, 2))[1])
    _, cache = step(token, cache)
    assert fused_traced and not any(fused_traced)
    assert len(jax.tree.leaves(step.args)) <= len(jax.tree.leaves(nnx.state(model)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  before = gen.TRACE_COUNTS["decode"]
  gen.decode_step_fn(model)(token, cache)  # prepared again, the same graphdef: no new compile
  assert gen.TRACE_COUNTS["decode"] == before


def test_top_k_and_top_p_keep_the_documented_tokens():
  """Probabilities 0.5, 0.25, 0.15, 0.1: top-p keeps the smallest top set whose mass reaches p
  (0.7 -> two tokens, 0.8 -> three), top-k 2 the two largest; samples never leave the kept set."""
  logits = jnp.log(jnp.asarray([[0.1, 0.5, 0.15, 0.25]]))
  def kept(top_k, top_p):
    return np.isfinite(np.asarray(sampling._filter(logits, jnp.asarray(top_k),
                                                   jnp.asarray(top_p, jnp.float32))))[0]
  np.testing.assert_array_equal(kept(0, 0.7), [False, True, False, True])
  np.testing.assert_array_equal(kept(0, 0.8), [False, True, True, True])
  np.testing.assert_array_equal(kept(2, 1.0), [False, True, False, True])
  np.testing.assert_array_equal(kept(3, 0.7), [False, True, False, True])
  params = sampling.make_sampling_params(1.0, 2, None)
  draws = jax.vmap(lambda key: sampling.sample_tokens(logits, key, params))(
      jax.random.split(jax.random.key(0), 200))
  assert set(np.asarray(draws).ravel().tolist()) == {1, 3}
  with pytest.raises(ValueError, match="top_p"):
    sampling.make_sampling_params(1.0, None, 1.5)


def test_stop_tokens_end_each_row_and_pad_the_rest():
  model = tiny_model("gdn_swa", init_std=0.2)
  prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4]]
  free = np.asarray(gen.generate(model, prompts, 12).tokens)
  stop = int(free[0, 3])
  out = gen.generate(model, prompts, 12, stop_tokens=[stop], pad_id=0)
  for row in range(2):
    hits = np.flatnonzero(free[row] == stop)
    n = int(hits[0]) + 1 if hits.size else 12
    assert int(out.lengths[row]) == n
    np.testing.assert_array_equal(out.tokens[row, :n], free[row, :n])
    assert not np.asarray(out.tokens[row, n:]).any()


def test_one_prompt_decodes_as_two_rows_and_returns_one(monkeypatch):
  """A single prompt runs as MIN_DECODE_ROWS identical rows (so one-row projections become
  GEMMs on the GPU) and comes back as one row, its stop decided by that row alone."""
  model = tiny_model("gdn_swa", init_std=0.2)
  built = []
  real_build = gen.caches.build_cache
  monkeypatch.setattr(gen.caches, "build_cache",
                      lambda config, batch, *rest: built.append(batch) or real_build(
                          config, batch, *rest))
  gen._generate_jit.clear_cache()  # trace again, so the cache's batch is recorded
  prompt = [[5, 6, 7, 8]]
  alone = gen.generate(model, prompt, 9)
  assert built == [gen.MIN_DECODE_ROWS] and alone.tokens.shape == (1, 9)
  assert alone.lengths.shape == (1,)
  pair = gen.generate(model, prompt * 2, 9)
  np.testing.assert_array_equal(alone.tokens[0], pair.tokens[0])
  stop = int(alone.tokens[0, 3])
  first = int(np.flatnonzero(np.asarray(alone.tokens[0]) == stop)[0]) + 1
  stopped = gen.generate(model, prompt, 9, stop_tokens=[stop])
  assert int(stopped.lengths[0]) == first
  np.testing.assert_array_equal(stopped.tokens[0, :first], alone.tokens[0, :first])
  assert not np.asarray(stopped.tokens[0, first:]).any()


# ----------------------------------------------------------------------------- input errors

def test_empty_prompt_raises():
  model = tiny_model("gdn")
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    gen.generate(model, [[1, 2], []], 4)
  with pytest.raises(ValueError, match="empty"):
    gen.prefill(model, np.zeros((1, 0), np.int32), gen.init_cache(model, 1))


def test_prompt_longer_than_the_full_attention_cache_raises():
  model = tiny_model("gdn_attn")
  cache = gen.init_cache(model, 1, max_length=8)
  with pytest.raises(ValueError, match="max_length=8"):
    gen.prefill(model, np.ones((1, 12), np.int32), cache)
  with pytest.raises(ValueError, match="max_length"):
    gen.init_cache(model, 1)  # full attention needs a capacity


def test_token_ids_outside_the_vocabulary_raise():
  model = tiny_model("gdn")
  with pytest.raises(ValueError, match=r"token id 256 is outside the vocabulary \[0, 256\)"):
    gen.generate(model, [[1, 256]], 4)


def test_non_positive_max_new_tokens_raises():
  model = tiny_model("gdn")
  with pytest.raises(ValueError, match="max_new_tokens"):
    gen.generate(model, [[1, 2]], 0)


def test_checkpoint_of_another_architecture_raises(tmp_path):
  model = tiny_model("gdn_swa", init_std=0.2)
  checkpoint.save_params(model, tmp_path / "ckpt")
  completions = cli.run(["--checkpoint", str(tmp_path / "ckpt"), "--prompt", "hi",
                         "--max-new-tokens", "5"])
  assert len(completions) == 1
  with pytest.raises(ValueError, match="holds a 'gdn_swa-tiny' model, not the requested"):
    cli.run(["--checkpoint", str(tmp_path / "ckpt"), "--model", "lalte-tiny", "--prompt", "x"])
  (tmp_path / "ckpt" / "model.json").write_text(json.dumps({"config_name": "transformer-tiny"}))
  with pytest.raises(ValueError, match="do not fit 'transformer-tiny'"):
    checkpoint.load_params(tmp_path / "ckpt")


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("saved") / "ckpt"
  checkpoint.save_params(tiny_model("gdn_swa", init_std=0.2), path)
  return path


# The error for each damage of a saved checkpoint (regular expressions, after its path).
DAMAGE_MESSAGES = {
    "no model.json": "lacks model.json or params/",
    "no params/_METADATA": "is damaged or incomplete: params/_METADATA is missing",
    "truncated": r"is damaged or incomplete: params/ocdbt.process_0/d/\w+ has \d+ bytes",
    "garbage": r"is damaged or incomplete: params/ocdbt.process_0/d/\w+ differs from what was",
    "truncated, no checksums": "is damaged: the parameters are unreadable .*OUT_OF_RANGE",
}


@pytest.mark.parametrize("kind", DAMAGE_MESSAGES)
def test_damaged_checkpoint_exits_2_with_one_line(saved_checkpoint, tmp_path, capsys, kind):
  directory = tmp_path / "ckpt"
  shutil.copytree(saved_checkpoint, directory)
  if kind == "no model.json":
    (directory / "model.json").unlink()
  elif kind == "no params/_METADATA":
    (directory / "params" / "_METADATA").unlink()
  elif kind.startswith("truncated"):
    damage.truncate(damage.largest_array_file(directory / "params"))
    if kind.endswith("no checksums"):
      (directory / "checksums.json").unlink()
  else:
    damage.overwrite_middle(damage.largest_array_file(directory / "params"))
  assert cli.main(["--checkpoint", str(directory), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1, err
  assert re.match(f"error: checkpoint: {directory} {DAMAGE_MESSAGES[kind]}", err), err


def test_cli_takes_and_prints_token_ids(tmp_path, capsys):
  model = tiny_model("gdn_swa", init_std=0.2)
  checkpoint.save_params(model, tmp_path / "ckpt")
  arguments = ["--checkpoint", str(tmp_path / "ckpt"), "--max-new-tokens", "6", "--print-ids"]
  expected = gen.generate(model, [[1, 5, 9], [7]], 6)
  expected_lines = [",".join(str(int(i)) for i in row[:int(n)])
                    for row, n in zip(expected.tokens, expected.lengths)]
  cli.main([*arguments, "--prompt-ids", "1,5,9", "--prompt-ids", "7"])
  assert capsys.readouterr().out.splitlines() == expected_lines
  cli.main([*arguments, "--prompt-ids", "1,5,9", "--prompt-ids", "7",
            "--prefill-chunk-tokens", "2"])
  assert capsys.readouterr().out.splitlines() == expected_lines


@pytest.mark.parametrize("ids, message", [
    ("1,x,9", "--prompt-ids '1,x,9': expected comma-separated token ids"),
    ("1,,2", "--prompt-ids '1,,2': expected comma-separated token ids"),
    ("3,256", r"--prompt-ids '3,256': id 256 is outside the model's vocabulary \[0, 256\)"),
    ("-1", r"id -1 is outside the model's vocabulary"),
])
def test_cli_bad_prompt_ids_exit_2_with_one_line(tmp_path, capsys, ids, message):
  checkpoint.save_params(tiny_model("gdn_swa", init_std=0.2), tmp_path / "ckpt")
  assert cli.main(["--checkpoint", str(tmp_path / "ckpt"), f"--prompt-ids={ids}"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1, err
  assert re.search(message, err), err
