"""A decode step updates the model's stacked cache in place: no copy of the cache, or of a layer
group's slice of it, per token (`lalte_jax.inference.group_slot`, `pallas_kernels.stacked`).

- "xla" (the CPU path): the compiled step, cache donated as `generate` donates it, holds no
  buffer the size of a cache leaf or of one group's part of it besides the cache itself, and its
  temporaries do not grow with the cache (full attention and NSA at max_length 2K and 8K).
- "pallas": the step lowered for a GPU at the 0.4b shapes passes the stacked cache leaves whole to
  the kernels (with the group index), the kernels that write a cache alias it, and no group
  slice is cut out; in interpret mode on the CPU the steps give the "xla" steps' logits.
- `generate`'s loop: the decode steps inside it make no cache-sized buffer either (on the CPU at
  the tiny presets; compiled for the GPU at 0.4b shapes in a `gpu` test), and with the layer
  groups split before the loop (`stack.decode_groups`, the GPU's way) no buffer the size of a
  weight either, so a token of `generate` moves the bytes of a step sent alone.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lalte_jax import generate as gen
from lalte_jax.config import get_model_config
from lalte_jax.inference import caches, stack
from lalte_jax.model import HybridLM

FAMILIES = ["gdn", "gdn_swa", "gdn_attn", "lalte", "lansa"]
BATCH = 4


def with_implementation(config, implementation):
  fields = {name: dataclasses.replace(getattr(config, name), implementation=implementation)
            for name in ("gdn", "attention", "lte", "nsa") if getattr(config, name) is not None}
  return config.replace(**fields)


def abstract_cache(config, batch, max_length):
  """The cache's shapes (nothing allocated); max_length only for the models that need it."""
  max_length = max_length if caches.needs_max_length(config, None) else None
  return jax.eval_shape(lambda: caches.build_cache(config, batch, max_length, None))


def checked_leaves(cache) -> dict:
  """{leaf path: stacked shape} of the cache leaves that a step must not copy: keys, values,
  scores and recurrent states. The GDN conv rings (conv_size taps, read whole by design) and the
  small bookkeeping leaves (positions, lengths) are left out."""
  return {jax.tree_util.keystr(path): tuple(leaf.shape)
          for path, leaf in jax.tree_util.tree_leaves_with_path(cache.layers)
          if leaf.ndim >= 4 and "conv" not in jax.tree_util.keystr(path)}


def _by_shape(shapes_by_name: dict) -> dict:
  """{shape: name} for each named stacked shape [G, ...] and its per-group shape [...]."""
  shapes = {}
  for name, shape in shapes_by_name.items():
    shapes[shape] = shapes[shape[1:]] = name
  return shapes


def weight_shapes(model) -> dict:
  """{shape: parameter path} of the weight matrices (2+ dims, 4096+ elements), stacked [G, ...]
  and per group, and of the groups prepared for decoding (`stack.split_groups`: the GDN layers'
  fused input kernels): a buffer of such a shape inside the decode loop is a copy of a weight."""
  def matrices(state) -> dict:
    return {jax.tree_util.keystr(path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_leaves_with_path(state)
            if leaf.ndim >= 2 and leaf.size >= 4096}

  _, group_states = jax.eval_shape(lambda: stack.split_groups(model))
  split = {shape: f"split group {name}" for name, shape in matrices(group_states[0]).items()}
  return {**split, **_by_shape(matrices(nnx.state(model, nnx.Param)))}


def leaf_shapes(cache) -> dict:
  """{shape: leaf path} of the checked leaves, stacked [G, ...] and per group."""
  return _by_shape(checked_leaves(cache))


# --- the compiled "xla" step ------------------------------------------------------------------

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = \w+\[([\d,]*)\]\S* ([\w\-]+)\((.*)$")
# Instructions that produce no new buffer of their own (or update their operand in place).
_NO_NEW_BUFFER = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
                  "dynamic-update-slice", "scatter"}


def _computations(hlo_text: str) -> dict:
  """{computation: {instruction name: (op, shape, rest of line)}, with "root" naming the root}."""
  computations, current = {}, None
  for line in hlo_text.splitlines():
    start = _COMPUTATION.match(line)
    if start and not line.startswith(" "):
      current = computations.setdefault(start.group(1), {})
      continue
    found = _INSTRUCTION.match(line)
    if current is not None and found:
      root, name, dims, op, rest = found.groups()
      current[name] = (op, tuple(int(d) for d in dims.split(",") if d), rest)
      if root:
        current["root"] = name
  return computations


def _updates_in_place(computations: dict, fused: str) -> bool:
  """Whether a fused computation's root (under bitcasts) is a dynamic-update-slice or scatter."""
  body = computations[fused]
  op, _, rest = body[body["root"]]
  while op == "bitcast":
    op, _, rest = body[re.match(r"\s*%?([\w.\-]+)", rest).group(1)]
  return op in ("dynamic-update-slice", "scatter")


def loop_computations(hlo_text: str, scope: str) -> set[str]:
  """The computations run by the while loops whose op_name holds the name scope `scope` (their
  bodies and conditions, and what those call), where XLA's own copies of loop-carried buffers
  would sit (such copies carry no op_name of their own)."""
  computations = _computations(hlo_text)
  instructions = lambda body: [entry for name, entry in body.items() if name != "root"]
  # A while's value is a tuple, which _INSTRUCTION does not parse: read its lines directly.
  pending = [called for line in hlo_text.splitlines()
             if " while(" in line and f"/{scope}/" in line
             for called in re.findall(r"(?:body|condition)=%?([\w.\-]+)", line)]
  found = set()
  while pending:
    computation = pending.pop()
    if computation in found or computation not in computations:
      continue
    found.add(computation)
    pending += [called for _, _, rest in instructions(computations[computation])
                for called in re.findall(r"(?:body|condition|to_apply|calls)=%?([\w.\-]+)", rest)]
  return found


def cache_sized_buffers(hlo_text: str, leaf_shapes: dict, within: set[str] | None = None
                        ) -> list[str]:
  """Instructions outside fusions that produce a new buffer of a checked leaf's shape (per group,
  or the whole stack): copies, slices, and values computed into a buffer of their own (a group's
  new state written back afterwards is one more copy of it). In-place updates (a
  dynamic-update-slice or scatter, fused or not) and loop results are not new buffers.
  `within`: only these computations (e.g. `loop_computations`); None: all."""
  computations = _computations(hlo_text)
  found = []
  for computation, body in computations.items():
    if computation.startswith(("fused", "wrapped")):
      continue
    if within is not None and computation not in within:
      continue
    for name, entry in body.items():
      if name == "root":
        continue
      op, shape, rest = entry
      shape = shape[1:] if shape[:1] == (1,) else shape
      if shape not in leaf_shapes or op in _NO_NEW_BUFFER:
        continue
      fused = re.search(r"calls=%?([\w.\-]+)", rest) if op == "fusion" else None
      if not (fused and _updates_in_place(computations, fused.group(1))):
        found.append(f"{name} ({op}) {shape}: the size of {leaf_shapes[shape]}")
  return found


def compile_xla_decode(variant: str, max_length: int):
  """The tiny preset's decode step on "xla", compiled for the CPU at batch BATCH: (executable,
  temporary bytes, cache bytes, abstract cache)."""
  config = with_implementation(get_model_config(f"{variant}-tiny"), "xla")
  graphdef, state = nnx.split(HybridLM(config, rngs=nnx.Rngs(0)))
  cache = abstract_cache(config, BATCH, max_length)
  token = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
  decode_jit = gen._decode_jit  # pylint: disable=protected-access  # donates the cache
  compiled = decode_jit.lower(graphdef, state, token, cache).compile()
  analysis = compiled.memory_analysis()
  if analysis is None or not hasattr(analysis, "temp_size_in_bytes"):
    pytest.skip("this jaxlib's compiled executables report no memory_analysis()")
  return compiled, analysis.temp_size_in_bytes, caches.cache_bytes(cache), cache


@pytest.mark.slow
@pytest.mark.parametrize("variant", FAMILIES)
def test_xla_decode_step_makes_no_cache_sized_buffer(variant):
  sizes = (2048, 8192) if caches.needs_max_length(get_model_config(f"{variant}-tiny"), None) \
      else (2048,)
  measured = {}
  for max_length in sizes:
    compiled, temp_bytes, cache_bytes, cache = compile_xla_decode(variant, max_length)
    assert cache_sized_buffers(compiled.as_text(), leaf_shapes(cache)) == []
    measured[max_length] = (temp_bytes, cache_bytes)
  print(f"{variant}-tiny B{BATCH} (temporaries, cache) bytes by max_length: {measured}")
  if len(sizes) == 2:
    (small_temp, small_cache), (large_temp, large_cache) = measured[2048], measured[8192]
    # Before the in-place layout: 0.75-0.8 of the cache (13.1 of 16.9 MB for gdn_attn at 8K).
    assert large_temp - small_temp < 0.02 * (large_cache - small_cache), measured
    assert large_temp < 0.1 * large_cache, measured




def compiled_generate_loop(variant: str, size: str, batch: int, prompt: int, new_tokens: int):
  """`generate`'s compiled program for a preset (the default implementations of the backend):
  (HLO text, the computations of its decode loop, {shape: name} of its cache leaves and
  weights)."""
  config = get_model_config(f"{variant}-{size}")
  model = HybridLM(config, rngs=nnx.Rngs(0))
  # generate's own arguments, so the cache length is the one it chose, not a recomputation.
  # pylint: disable=protected-access
  args, options = gen._generate_arguments(model, np.ones((batch, prompt), np.int32), new_tokens)
  text = gen._generate_jit.lower(*args, **options).compile().as_text()
  cache = jax.eval_shape(lambda: caches.build_cache(config, batch, options["max_length"], None))
  loop = loop_computations(text, gen.DECODE_LOOP_SCOPE)
  assert len(loop) >= 2  # the loop's body and condition at least: the scope names it
  return text, loop, leaf_shapes(cache), weight_shapes(model)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["gdn_swa", "lalte"])
def test_generate_decode_loop_makes_no_cache_sized_buffer(variant):
  """The steps inside `generate`'s loop update the cache in place as the step alone does."""
  text, loop, cache_shapes, _ = compiled_generate_loop(variant, "tiny", BATCH, 64, 64)
  assert cache_sized_buffers(text, cache_shapes, loop) == []
  # The prefill before the loop (once per call) is left out: its group scan copies states on
  # the CPU, which the check would catch.
  assert cache_sized_buffers(text, cache_shapes) != []


@pytest.fixture
def fresh_traces():
  """jax's trace caches emptied before and after: the test traces generate's shapes differently."""
  jax.clear_caches()
  yield
  jax.clear_caches()


@pytest.mark.slow
def test_generate_with_split_groups_copies_no_weight_in_its_loop(monkeypatch, fresh_traces):
  """The GPU's way (groups split before the loop), compiled on the CPU: no weight-sized buffer
  in the loop, where the CPU's rolled group loop slices every weight out each step."""
  text, loop, _, weights = compiled_generate_loop("gdn_swa", "tiny", BATCH, 64, 64)
  assert cache_sized_buffers(text, weights, loop) != []  # the check sees the rolled loop's slices
  monkeypatch.setattr(stack, "decode_groups", stack.split_groups)
  jax.clear_caches()  # the trace of these shapes used the rolled loop
  text, loop, cache_shapes, weights = compiled_generate_loop("gdn_swa", "tiny", BATCH, 64, 64)
  assert cache_sized_buffers(text, weights, loop) == []
  assert cache_sized_buffers(text, cache_shapes, loop) == []


def test_split_groups_decode_as_the_rolled_loop():
  """decode_impl over groups split by `split_groups` (one after another, the GDN layers' input
  projections fused into one kernel) gives the rolled scan's logits and cache (laLTE: a GDN and
  an LTE block per group)."""
  model = HybridLM(get_model_config("lalte-tiny"), rngs=nnx.Rngs(0))
  graphdef, group_states = stack.split_groups(model)
  for group_state in group_states:
    gdn_mixer = nnx.merge(graphdef, group_state).blocks[0].mixer
    assert gdn_mixer.decode_only and not hasattr(gdn_mixer, "q_proj")
  cache = caches.build_cache(model.config, 2, 32, None)
  prompt = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 7)), jnp.int32)
  _, cache = stack.prefill_impl(model, prompt, jnp.ones((2, 7), bool), cache, False)
  token_B = jnp.asarray([3, 5], jnp.int32)
  rolled = stack.decode_impl(model, token_B, cache, None)
  split = stack.decode_impl(model, token_B, cache, (graphdef, group_states))
  for got, want in zip(jax.tree.leaves(split), jax.tree.leaves(rolled)):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["gdn_swa", "lalte"])
def test_generate_decode_loop_on_the_gpu_copies_no_cache_and_no_weight(variant):
  """The same at the 0.4b shapes, compiled for the GPU (Pallas kernels writing the cache, the
  groups split before the loop)."""
  text, loop, cache_shapes, weights = compiled_generate_loop(variant, "0.4b", 8, 256, 64)
  assert cache_sized_buffers(text, cache_shapes, loop) == []
  assert cache_sized_buffers(text, weights, loop) == []


def test_cache_sized_buffers_finds_a_group_slice():
  """The HLO check itself: a step that slices a group out of a stacked cache is caught."""
  stacked = jax.ShapeDtypeStruct((3, 4, 64, 2, 16), jnp.float32)

  def sliced(cache, group):
    part = jax.lax.dynamic_index_in_dim(cache, group, keepdims=False)
    return jnp.einsum("bskd,bskd->bk", part, part)

  text = jax.jit(sliced).lower(stacked, jax.ShapeDtypeStruct((), jnp.int32)).compile().as_text()
  assert cache_sized_buffers(text, {(4, 64, 2, 16): "k"}) != []


# --- the "pallas" step ------------------------------------------------------------------------

_TRITON_CALL = re.compile(r"stablehlo\.custom_call @__gpu\$xla\.gpu\.triton\((.*)")


def _tensor_shapes(types: str) -> list[tuple[int, ...]]:
  return [tuple(int(d) for d in dims.split("x") if d)
          for dims in re.findall(r"tensor<((?:\d+x)*)\w+>", types)]


def lowered_for_gpu(variant: str, monkeypatch):
  """decode_impl of the 0.4b preset with every mixer on "pallas", lowered for a GPU (abstract
  parameters and cache: nothing is allocated or compiled). Returns (text, cache)."""
  # The kernels choose Triton rather than interpret mode by the default backend.
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  config = with_implementation(get_model_config(f"{variant}-0.4b"), "pallas")
  graphdef, state = nnx.split(nnx.eval_shape(lambda: HybridLM(config, rngs=nnx.Rngs(0))))
  cache = abstract_cache(config, 8, 4096)
  step = jax.jit(lambda s, t, c: stack.decode_impl(nnx.merge(graphdef, s), t, c),
                 donate_argnums=(2,))
  lowered = step.trace(state, jax.ShapeDtypeStruct((8,), jnp.int32), cache).lower(
      lowering_platforms=("cuda",))
  return lowered.as_text(), cache


@pytest.mark.parametrize("variant,writers", [
    ("gdn", {"gdn_fused_recurrent"}), ("gdn_swa", {"gdn_fused_recurrent"}),
    ("gdn_attn", {"gdn_fused_recurrent"}),
    ("lalte", {"gdn_fused_recurrent", "lte_evict_and_insert"}),
    ("lansa", {"gdn_fused_recurrent"})])
def test_pallas_kernels_take_the_stacked_cache(variant, writers, monkeypatch):
  text, cache = lowered_for_gpu(variant, monkeypatch)
  stacked = {shape: name for name, shape in checked_leaves(cache).items()}
  read_whole, aliased = set(), set()
  for call in _TRITON_CALL.finditer(text):
    attributes, types = call.group(1).rsplit(" : (", 1)
    operand_types, result_types = types.split(") -> ")
    read_whole |= {stacked[s] for s in _tensor_shapes(operand_types) if s in stacked}
    if "output_operand_aliases" in attributes and any(
        s in stacked for s in _tensor_shapes(result_types)):
      aliased.add(re.search(r'name = "([a-z_]+)"', attributes).group(1))
  # Every checked leaf (GDN states, attention / NSA / LTE keys, values, scores) reaches a kernel
  # whole, and the kernels that write the cache write the stacked buffers.
  assert read_whole == set(stacked.values()), (read_whole, stacked)
  assert aliased == writers
  per_group = {shape[1:] for shape in stacked}
  cut = [types for types in re.findall(r"stablehlo\.(?:dynamic_slice|slice|gather)\b.*-> (.*)",
                                       text)
         if any(s[:1] == (1,) and s[1:] in per_group for s in _tensor_shapes(types))]
  assert cut == []


def teacher_forced_logits(model, tokens_BT, prompt_len: int) -> np.ndarray:
  """Logits of decode steps fed tokens[:, prompt_len:] after an "xla" prefill of the prompt,
  in one jitted scan."""
  batch, length = tokens_BT.shape
  xla_model = HybridLM(with_implementation(model.config, "xla"), rngs=nnx.Rngs(0))
  cache = gen.init_cache(model, batch, max_length=length)
  _, cache = gen.prefill(xla_model, tokens_BT[:, :prompt_len], cache)

  @jax.jit
  def decode_all(state, cache, tokens_TB):
    step = lambda cache, token_B: stack.decode_impl(nnx.merge(graphdef, state), token_B, cache
                                                    )[::-1]
    return jax.lax.scan(step, cache, tokens_TB)[1]

  graphdef, state = nnx.split(model)
  return np.asarray(decode_all(state, cache, jnp.asarray(tokens_BT[:, prompt_len:].T)))


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["gdn_swa", "lalte", "lansa"])
def test_pallas_decode_steps_give_the_xla_logits(variant):
  """Interpret mode: the GDN recurrent step, decode attention (SWA ring, LTE cache), the LTE
  evict/insert step and NSA decoding on layer group 1 of 2; 30 steps pass the SWA window (48
  with the 30-token prompt), LTE evictions and decode-time scoring, and NSA blocks."""
  config = get_model_config(f"{variant}-tiny").replace(init_std=0.2)
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 60)).astype(np.int32)
  logits = {name: teacher_forced_logits(
      HybridLM(with_implementation(config, name), rngs=nnx.Rngs(0)), tokens, 30)
      for name in ("xla", "pallas")}
  scale = np.abs(logits["xla"]).max()
  np.testing.assert_allclose(logits["pallas"], logits["xla"], rtol=0, atol=1e-5 * scale)
