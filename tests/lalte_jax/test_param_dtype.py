"""Parameters held in bfloat16 for inference (`lalte_jax.inference.param_dtype`): which parameters
are cast, decoding with them stays within the bfloat16 tolerance of float32 parameters, no decode
step converts them back to float32, and the loaders and CLIs take the choice."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jax_core

from lalte_jax import generate as gen
from lalte_jax.inference import checkpoint, cli, stack
from lalte_jax.inference.param_dtype import cast_params_for_inference
from tests.kernel_testing import relative_error, tolerance
from tests.lalte_jax.test_generate import LTE_BIAS_WITHIN_CAP, tiny_model

FAMILIES = ["gdn", "gdn_swa", "lalte", "lansa"]  # every mixer kind with a decode path
# The parameters that stay float32: 1-D vectors of float32 math (by their last path key).
FLOAT32_NAMES = {"weight", "A_log", "dt_bias", "o_norm_weight", "proj_bias"}
FLOAT32_OWNERS = {"final_norm", "mixer_norm", "mlp_norm", "mixer", "router"}


def family_model(variant: str):
  """The float32 model of the teacher-forced decoding test (its compiles are shared)."""
  return tiny_model(variant, lte_bias=LTE_BIAS_WITHIN_CAP if variant == "lalte" else None)


def params_by_path(model) -> dict[tuple, jax.Array]:
  pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  return {tuple(k.key for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(pure)[0]}


def param_dtypes(model) -> dict[tuple, jnp.dtype]:
  return {path: leaf.dtype for path, leaf in params_by_path(model).items()}


@pytest.mark.parametrize("variant", FAMILIES)
def test_matrices_become_bfloat16_and_vectors_stay_float32(variant):
  model = family_model(variant)
  cast = param_dtypes(cast_params_for_inference(model, "bfloat16"))
  kept = {path for path, dtype in cast.items() if dtype == jnp.float32}
  assert kept == {path for path in cast
                  if path[-1] in FLOAT32_NAMES and path[-2] in FLOAT32_OWNERS}, kept
  assert set(cast.values()) == {jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)}
  assert cast[("embed", "embedding")] == jnp.bfloat16
  assert set(param_dtypes(model).values()) == {jnp.dtype(jnp.float32)}  # the input is unchanged
  assert set(param_dtypes(cast_params_for_inference(model, "float32")).values()) == {
      jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("variant", FAMILIES)
def test_greedy_decoding_with_bfloat16_params_matches_float32_params(variant):
  """Float32 activations, so that the parameters' rounding is the only difference: the prompt's
  and 8 greedy steps' logits (both models fed the float32 model's greedy tokens) agree within the
  bfloat16 tolerance (relative to the largest logit), and so do the greedy tokens wherever the
  float32 top two differ by more than twice the largest logit difference. Shapes are those of the
  teacher-forced decoding test: batch 2 (row 1 left-padded), a 30-token prompt, an 80-token
  cache."""
  model = family_model(variant)
  models = {"float32": model, "bfloat16": cast_params_for_inference(model, "bfloat16")}
  prompt = np.random.default_rng(0).integers(0, 256, (2, 30)).astype(np.int32)
  valid = np.ones((2, 30), bool)
  valid[1, :7] = False
  prompt[1, :7] = 0
  caches = {name: gen.init_cache(m, 2, max_length=80) for name, m in models.items()}
  logits = {}
  for name, m in models.items():
    logits[name], caches[name] = gen.prefill(m, prompt, caches[name], pad_mask=valid,
                                             all_logits=True)
    logits[name] = [np.asarray(logits[name][0]), np.asarray(logits[name][1, 7:])]
  token = np.asarray([logits["float32"][0][-1].argmax(), logits["float32"][1][-1].argmax()])
  steps = {name: [] for name in models}
  for _ in range(8):
    for name, m in models.items():
      step_logits, caches[name] = gen.decode_step(m, token, caches[name])
      steps[name].append(np.asarray(step_logits))
    token = steps["float32"][-1].argmax(-1).astype(np.int32)
  want, got = (np.concatenate([*logits[name], *steps[name]]) for name in models)  # [69, V]
  assert 0 < relative_error(got, want) <= tolerance(jnp.bfloat16), (
      f"max |logit difference| {np.abs(got - want).max():.3e}, largest {np.abs(want).max():.3e}")
  top2 = np.sort(want, axis=-1)[:, -2:]
  clear = top2[:, 1] - top2[:, 0] > 2 * np.abs(got - want).max()
  assert clear.sum() > len(want) // 2  # most positions have a clear greedy token to compare
  np.testing.assert_array_equal(got[clear].argmax(-1), want[clear].argmax(-1))


@pytest.mark.slow  # four bfloat16 compiles: ~20 s on a loaded 2-core CPU
def test_with_bfloat16_activations_bfloat16_params_change_no_logit():
  """Every matrix is cast to the activation dtype where it is used, so storing it in bfloat16 gives
  bit-identical logits (prompt and greedy steps). laLTE has every kind of matrix: GDN projections
  and short convs, attention projections, the router, MLP, embedding."""
  float32_model = family_model("lalte")
  model = checkpoint.model_from_param_dict(float32_model.config.replace(dtype="bfloat16"),
                                           nnx.to_pure_dict(nnx.state(float32_model, nnx.Param)))
  prompt = np.random.default_rng(0).integers(0, 256, (2, 30)).astype(np.int32)
  logits = []
  for m in (model, cast_params_for_inference(model, "bfloat16")):
    cache = gen.init_cache(m, 2, max_length=80)
    prompt_logits, cache = gen.prefill(m, prompt, cache, all_logits=True)
    steps = [*np.asarray(prompt_logits)]
    step_logits = prompt_logits[:, -1]
    for _ in range(4):
      step_logits, cache = gen.decode_step(m, np.asarray(step_logits.argmax(-1), np.int32), cache)
      steps.append(np.asarray(step_logits))
    logits.append(np.concatenate(steps))
  np.testing.assert_array_equal(logits[1], logits[0])


# Primitives that only move or slice a parameter's elements: their output is still the parameter.
# Not gather: the embedding lookup's rows are the step's activations, which the norms upcast.
LAYOUT_PRIMITIVES = {"transpose", "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "slice",
                     "dynamic_slice", "concatenate", "copy", "copy_p", "rev"}


def parameters_converted_to_float32(jaxpr, tainted: set) -> tuple[set, list]:
  """Follows the variables in `tainted` (parameters) through layout ops and into nested jaxprs
  (scan, jit, custom derivatives, while: operands map positionally onto their inputs); returns
  the tainted variables and the shapes of the tainted bfloat16 arrays converted to float32."""
  tainted, found = set(tainted), []
  is_tainted = lambda v: isinstance(v, jax_core.Var) and v in tainted
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "convert_element_type" and is_tainted(eqn.invars[0]):
      if eqn.params["new_dtype"] == jnp.float32 and eqn.invars[0].aval.dtype == jnp.bfloat16:
        found.append(tuple(eqn.invars[0].aval.shape))
      continue
    operands = list(eqn.invars)
    if name == "while":  # cond_consts, body_consts, carry -> body sees body_consts and carry
      operands = operands[eqn.params["cond_nconsts"]:]
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        inner = getattr(sub, "jaxpr", sub)
        if isinstance(inner, jax_core.Jaxpr) and len(inner.invars) == len(operands):
          inner_tainted, inner_found = parameters_converted_to_float32(
              inner, {v for v, o in zip(inner.invars, operands) if is_tainted(o)})
          found += inner_found
          if len(inner.outvars) == len(eqn.outvars):
            tainted |= {o for o, v in zip(eqn.outvars, inner.outvars) if v in inner_tainted}
    if name in LAYOUT_PRIMITIVES and any(map(is_tainted, eqn.invars)):
      tainted |= set(eqn.outvars)
  return tainted, found


def decode_converts(model) -> list:
  """The shapes of the bfloat16 parameters (or views of them) that a decode step converts to
  float32, from its trace (nothing is compiled)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  cache = gen.init_cache(model, 2, max_length=64)
  step = lambda params, cache: stack.decode_impl(nnx.merge(graphdef, params, rest),
                                                 jnp.zeros((2,), jnp.int32), cache)
  closed = jax.make_jaxpr(step)(params, cache)
  num_params = len(jax.tree.leaves(params))
  return parameters_converted_to_float32(closed.jaxpr, set(closed.jaxpr.invars[:num_params]))[1]


@pytest.mark.parametrize("variant", FAMILIES)
def test_decode_step_converts_no_bfloat16_parameter_to_float32(variant):
  """With bfloat16 activations every matrix is used in bfloat16. With float32 activations each is
  converted where it is used (the compute dtype asks for it), which shows the check finds them."""
  float32_model = family_model(variant)
  params = nnx.to_pure_dict(nnx.state(float32_model, nnx.Param))
  converts = {}
  for dtype in ("bfloat16", "float32"):
    model = checkpoint.model_from_param_dict(float32_model.config.replace(dtype=dtype), params)
    converts[dtype] = decode_converts(cast_params_for_inference(model, "bfloat16"))
  assert not converts["bfloat16"], converts["bfloat16"]
  assert (64, 256) in converts["float32"]  # the tied LM head: the embedding's transpose
  assert len(converts["float32"]) >= 8  # embedding, head, q/k/v/o or GDN projections, MLP


def test_load_params_holds_bfloat16_matrices_and_the_cli_decodes_with_them(tmp_path, capsys,
                                                                           monkeypatch):
  model = tiny_model("gdn_swa", init_std=0.2)
  checkpoint.save_params(model, tmp_path / "ckpt")
  loaded = checkpoint.load_model(tmp_path / "ckpt", param_dtype="bfloat16")
  want = params_by_path(cast_params_for_inference(model, "bfloat16"))
  got = params_by_path(loaded)
  assert {path: leaf.dtype for path, leaf in got.items()} == param_dtypes(
      cast_params_for_inference(model, "bfloat16"))
  for path, leaf in want.items():
    np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(leaf), err_msg=str(path))
  cli_models = []
  load_params = checkpoint.load_params
  monkeypatch.setattr(checkpoint, "load_params",
                      lambda *args, **kwargs: cli_models.append(load_params(*args, **kwargs))
                      or cli_models[-1])
  cli.main(["--checkpoint", str(tmp_path / "ckpt"), "--param-dtype", "bfloat16",
            "--prompt-ids", "1,5,9", "--max-new-tokens", "6", "--print-ids"])
  assert param_dtypes(cli_models[0]) == param_dtypes(loaded)
  expected = gen.generate(loaded, [[1, 5, 9]], 6).tokens[0]
  assert capsys.readouterr().out.split() == [",".join(str(int(i)) for i in expected)]


def test_bad_param_dtype_names_the_argument(tmp_path):
  with pytest.raises(ValueError, match=r"param_dtype: expected one of \('float32', 'bfloat16'\),"
                                       r" got 'float16'"):
    checkpoint.load_params(tmp_path / "missing", param_dtype="float16")
  with pytest.raises(ValueError, match="param_dtype"):
    cast_params_for_inference(family_model("gdn"), "int8")
