"""The LTE router's cost in the training step, apart from the rest of the layer.

    python tools/bench_router.py --presets lalte-0.4b --batch 4 --seq_len 4096
    python tools/bench_router.py --presets lalte-tiny --batch 2 --seq_len 64 --repeats 2  # CPU

Per preset, at its LTE shapes (Hkv heads, head dim D, the router's conv layers) with bf16 keys and
values, three groups of variants; in each group every variant is timed in alternation with the
group's first (`pallas_kernels.benchmarking.paired_ms`: medians of `--repeats` rounds after 2),
and its ratio to that first one (`vs_first`) is what to compare across runs and machines (the
absolute times of these sub-millisecond calls moved by 15% between machines, 2026-11-29):
- `router fwd+bwd, dropout, XLA`: the gradient of the router's scores, summed, with respect to
  its weights, keys and values, under `jax.checkpoint` with the activations the training step's
  remat policy "attention" keeps (`lte_router.ROUTER_ACTIVATION`: the conv pre-activations and
  the logits), with the dropout key the step passes (`pallas_kernels.lte_router`, XLA);
- `router fwd+bwd, dropout, XLA, nothing kept`: the first row with everything recomputed (remat
  "block");
- `router fwd+bwd, no dropout, XLA`: the first row without a key (what the dropout adds);
- `router fwd+bwd, dropout, Pallas`: the first row with the fused Pallas kernels
  (`pallas_kernels/lte_router/pallas.py`; at presets whose router widths they take);
- `router fwd+bwd, dropout, XLA, everything kept` and `..., Pallas, everything kept`: both
  versions with every activation kept, as the training step's remat `none` (its default) does;
- `masks, hashed (ours)` and `masks, threefry (jax.random.bernoulli)`: the three dropout masks of
  one router call alone ([Hkv, B, T, C] for C = 2D, D, D/2), applied to bf16 activations, ours
  (pallas_kernels/lte_router/counter_hash.py) against JAX's standard Bernoulli draw;
- `conv layers fwd+bwd, batched einsum (ours)`, `..., shifted inputs in one matmul`,
  `..., batched einsum, float32 taps` and `..., grouped lax.conv, token-major`: the router's conv
  layers alone in XLA (no dropout or bias, SiLU between them), forward and backward, as the XLA
  version computes them (`reference.head_conv`: heads leading, every tap's output from one
  batched matmul in the input's dtype, shifted and summed in float32), with the taps' shifted
  inputs contracted in one matmul instead (`shifted_inputs_conv`), as it did before 2026-11-29
  (the taps in float32), and in the reference model's form, one grouped convolution (groups =
  Hkv) over token-major activations (cuDNN on GPUs).
Prints one JSON line per row and a markdown table; `--json PATH` writes them. `--profile` then
traces `--profile_steps` calls of the router's fwd+bwd as the training step runs it (every
activation kept: Pallas where the kernels take the preset's widths, and XLA; else the group's
first row) and adds their GPU time by kernel (tools/step_profile.py) to those rows ("profile"),
printed as a table each: which of the router's kernels take its time.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import sys

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # run as a script from a checkout
  sys.path.insert(0, str(_REPO_ROOT))

# pylint: disable=wrong-import-position
import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.lte_router import ROUTER_ACTIVATION, counter_hash
from pallas_kernels.lte_router import pallas as router_pallas
from pallas_kernels.lte_router import reference as router_reference
from lalte_jax.mixers.lte_router import LTERouter, channel_widths
from lalte_jax.presets import get_model_config
from pallas_kernels.benchmarking import Timed, paired_ms

import step_profile  # tools/step_profile.py

# The rows `--profile` traces: the training step's router (remat "none" keeps every activation).
PROFILED_ROWS = ("router fwd+bwd, dropout, Pallas, everything kept",
                 "router fwd+bwd, dropout, XLA, everything kept")


def hashed_dropout(x_KBTC, rate, key):
  return router_reference.dropped(x_KBTC, counter_hash.seed_words(key), rate)


def grouped_conv_same(h_KBTC, weight_KICO, dilation):
  """The XLA version's convolution (reference.head_conv) without a bias."""
  zero_bias = jnp.zeros((weight_KICO.shape[0], weight_KICO.shape[3]), h_KBTC.dtype)
  return router_reference.head_conv(h_KBTC, weight_KICO, zero_bias, dilation=dilation)


def threefry_dropout(x_KBTC, rate, key):
  """JAX's standard draw (the router's mask before the hash)."""
  keep_KBTC = jax.random.bernoulli(key, 1.0 - rate, x_KBTC.shape)
  return jnp.where(keep_KBTC, x_KBTC / (1.0 - rate), jnp.zeros_like(x_KBTC))


def _shifted_taps(h_KBTC: jax.Array, kernel_size: int, dilation: int) -> jax.Array:
  """[K, B, T, taps * C]: for each tap i, the input at offset i * dilation - half (zeros past
  either end), taps concatenated along the channels."""
  length = h_KBTC.shape[2]
  half = (kernel_size // 2) * dilation
  padded_KBTC = jnp.pad(h_KBTC, ((0, 0), (0, 0), (half, half), (0, 0)))
  return jnp.concatenate([padded_KBTC[:, :, i * dilation:i * dilation + length]
                          for i in range(kernel_size)], axis=-1)


def _shifted_inputs_matmul(h_KBTC: jax.Array, weight_KICO: jax.Array, dilation: int) -> jax.Array:
  heads, kernel_size, c_in, c_out = weight_KICO.shape
  return jnp.einsum("kbtj,kjo->kbto", _shifted_taps(h_KBTC, kernel_size, dilation),
                    weight_KICO.reshape(heads, kernel_size * c_in, c_out),
                    preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def shifted_inputs_conv(h_KBTC, weight_KICO, dilation):
  """The router's convolution as the taps' shifted inputs, concatenated along the channels and
  contracted in one batched matmul; the backward in the same form (dx: the 'same' conv of the
  gradient with flipped, transposed taps; dW: one matmul over the shifted inputs). Measured 2.3x
  slower than the tap outputs summed on an H200 (2026-11-29): XLA materialises the concatenated
  inputs instead of reading them inside the matmul."""
  return _shifted_inputs_matmul(h_KBTC, weight_KICO, dilation)


def _shifted_inputs_fwd(h_KBTC, weight_KICO, dilation):
  return _shifted_inputs_matmul(h_KBTC, weight_KICO, dilation), (h_KBTC, weight_KICO)


def _shifted_inputs_bwd(dilation, residuals, g_KBTO):
  h_KBTC, weight_KICO = residuals
  heads, kernel_size, c_in, c_out = weight_KICO.shape
  g_KBTO = g_KBTO.astype(h_KBTC.dtype)
  # dx[s] = sum_i g[s - i * dilation + half] W_i^T = sum_j g[s + j * dilation - half] W'_j with
  # W'_j = W_{taps-1-j}^T: the same 'same' convolution of g.
  flipped_KIOC = jnp.swapaxes(jnp.flip(weight_KICO, axis=1), 2, 3)
  dh_KBTC = _shifted_inputs_matmul(g_KBTO, flipped_KIOC, dilation).astype(h_KBTC.dtype)
  dweight_KJO = jnp.einsum("kbtj,kbto->kjo", _shifted_taps(h_KBTC, kernel_size, dilation), g_KBTO,
                           preferred_element_type=jnp.float32)
  return dh_KBTC, dweight_KJO.reshape(weight_KICO.shape).astype(weight_KICO.dtype)


shifted_inputs_conv.defvjp(_shifted_inputs_fwd, _shifted_inputs_bwd)


def float32_taps_conv(h_KBTC, weight_KICO, dilation):
  """The router's convolution before 2026-11-29: the same batched matmul with float32 taps."""
  length, kernel_size = h_KBTC.shape[2], weight_KICO.shape[1]
  y_KBTIO = jnp.einsum("kbtc,kico->kbtio", h_KBTC, weight_KICO,
                       preferred_element_type=jnp.float32)
  half = (kernel_size // 2) * dilation
  padded_KBTIO = jnp.pad(y_KBTIO, ((0, 0), (0, 0), (half, half), (0, 0), (0, 0)))
  return sum(padded_KBTIO[:, :, i * dilation:i * dilation + length, i]
             for i in range(kernel_size)).astype(h_KBTC.dtype)


def lax_grouped_conv(h_BTKC, weight_KICO, dilation):
  """The reference's form: one grouped convolution (groups = heads) over token-major channels."""
  batch, length, heads, c_in = h_BTKC.shape
  kernel_size, c_out = weight_KICO.shape[1], weight_KICO.shape[3]
  weight_WIO = jnp.transpose(weight_KICO, (1, 2, 0, 3)).reshape(kernel_size, c_in, heads * c_out)
  half = (kernel_size // 2) * dilation
  out_BTF = jax.lax.conv_general_dilated(
      h_BTKC.reshape(batch, length, heads * c_in), weight_WIO, window_strides=(1,),
      padding=((half, half),), rhs_dilation=(dilation,), dimension_numbers=("NWC", "WIO", "NWC"),
      feature_group_count=heads)
  return out_BTF.reshape(batch, length, heads, c_out)


def paired_group(preset: str, group: list[tuple[str, Timed]], repeats: int) -> list[dict]:
  """Rows of one group of variants, the first its anchor: each other variant is timed in
  alternation with the anchor (`paired_ms`, after 2 warm-up rounds), so its ratio to the anchor
  (`vs_first`) comes from the same moments of the GPU; the anchor's ms is the median of its
  pairings."""
  (anchor_name, anchor), rows, anchor_ms = group[0], [], []
  for name, timed in group[1:]:
    first_ms, ms = paired_ms(anchor, timed, warmup=2, rounds=repeats)
    anchor_ms.append(first_ms)
    rows.append({"preset": preset, "row": name, "ms": ms, "vs_first": ms / first_ms})
  return [{"preset": preset, "row": anchor_name, "ms": statistics.median(anchor_ms),
           "vs_first": 1.0}] + rows


def router_rows(preset: str, batch: int, seq_len: int, repeats: int,
                profile_steps: int = 0) -> list[dict]:
  lte = get_model_config(preset).lte
  router = LTERouter(lte, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(router)
  kv_key, dropout_key = jax.random.split(jax.random.key(0))
  shape = (batch, seq_len, lte.num_kv_heads, lte.head_dim)
  k_BTKD, v_BTKD = (jax.random.normal(key, shape, jnp.bfloat16)
                    for key in jax.random.split(kv_key))

  rows, group, grads = [], [], {}
  keep_activations = jax.checkpoint_policies.save_only_these_names(ROUTER_ACTIVATION)
  every = lambda _, *args, **kwargs: True  # remat "none": the step keeps every activation
  groups = [[("router fwd+bwd, dropout, XLA", "xla", dropout_key, keep_activations),
             ("router fwd+bwd, dropout, XLA, nothing kept", "xla", dropout_key, None),
             ("router fwd+bwd, no dropout, XLA", "xla", None, keep_activations)]]
  try:  # the Pallas kernels take power-of-two widths >= 16 (not the tiny presets')
    router_pallas.check_supported(k_BTKD, [w[...] for w in router.conv_weights])
    groups[0].append(("router fwd+bwd, dropout, Pallas", "pallas", dropout_key, keep_activations))
    groups.append([("router fwd+bwd, dropout, XLA, everything kept", "xla", dropout_key, every),
                   ("router fwd+bwd, dropout, Pallas, everything kept", "pallas", dropout_key,
                    every)])
  except NotImplementedError as error:
    print(f"{preset}: no Pallas rows ({error})", file=sys.stderr)
  for variants in groups:
    for name, implementation, key, policy in variants:
      def score_sum(params, k, v, key=key, implementation=implementation):
        return jnp.sum(nnx.merge(graphdef, params)(k, v, dropout_key=key,
                                                   implementation=implementation))
      grad = jax.jit(jax.grad(jax.checkpoint(score_sum, policy=policy), argnums=(0, 1, 2)))
      grads[name] = grad
      group.append((name, Timed(grad, [(params, k_BTKD, v_BTKD)])))
    rows += paired_group(preset, group, repeats)
    group = []
  if profile_steps:
    profiled = [r for r in rows if r["row"] in PROFILED_ROWS] or rows[:1]
    for row in profiled:
      grad = grads[row["row"]]
      hlo_text = grad.lower(params, k_BTKD, v_BTKD).compile().as_text()
      row["profile"], _ = step_profile.profile_step(
          lambda _: grad(params, k_BTKD, v_BTKD), None, hlo_text, steps=profile_steps)
  widths = channel_widths(lte.head_dim, len(lte.router_kernel_sizes))[:-1]
  activations = [jnp.ones((lte.num_kv_heads, batch, seq_len, width), jnp.bfloat16)
                 for width in widths]
  for name, draw in (("masks, hashed (ours)", hashed_dropout),
                     ("masks, threefry (jax.random.bernoulli)", threefry_dropout)):
    masks = jax.jit(lambda xs, key, draw=draw: [
        draw(x, lte.router_dropout, layer_key)
        for x, layer_key in zip(xs, jax.random.split(key, len(xs)))])
    group.append((name, Timed(masks, [(activations, dropout_key)])))
  rows += paired_group(preset, group, repeats)
  group = []
  weights = [w[...].astype(jnp.bfloat16) for w in router.conv_weights]
  h_BTKC = jnp.concatenate([k_BTKD, v_BTKD], axis=-1)
  for name, conv, h in (
      ("conv layers fwd+bwd, batched einsum (ours)",
       lambda h, w, d: grouped_conv_same(h, w, d).astype(h.dtype),
       jnp.transpose(h_BTKC, (2, 0, 1, 3))),
      ("conv layers fwd+bwd, shifted inputs in one matmul",
       lambda h, w, d: shifted_inputs_conv(h, w, d).astype(h.dtype),
       jnp.transpose(h_BTKC, (2, 0, 1, 3))),
      ("conv layers fwd+bwd, batched einsum, float32 taps", float32_taps_conv,
       jnp.transpose(h_BTKC, (2, 0, 1, 3))),
      ("conv layers fwd+bwd, grouped lax.conv, token-major", lax_grouped_conv, h_BTKC)):
    def conv_sum(weights, h, conv=conv):
      for weight, dilation in zip(weights, lte.router_dilations):
        h = jax.nn.silu(conv(h, weight, dilation))
      return jnp.sum(h.astype(jnp.float32))
    conv_grad = jax.jit(jax.grad(conv_sum, argnums=(0, 1)))
    group.append((name, Timed(conv_grad, [(weights, h)])))
  rows += paired_group(preset, group, repeats)
  for row in rows:
    row.update(batch=batch, seq_len=seq_len, kv_heads=lte.num_kv_heads, head_dim=lte.head_dim,
               dropout=lte.router_dropout, device=jax.devices()[0].device_kind)
    print(json.dumps(row), flush=True)
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--presets", nargs="+", default=["lalte-0.4b", "lalte-1.4b"])
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq_len", type=int, default=4096)
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--json", default="", help="also write the rows here")
  parser.add_argument("--profile", action="store_true",
                      help="also trace the training step's router rows and break their GPU time"
                           " down by kernel (tools/step_profile.py)")
  parser.add_argument("--profile_steps", type=int, default=10, help="calls traced by --profile")
  args = parser.parse_args(argv)
  if args.batch < 1 or args.seq_len < 1 or args.repeats < 1 or args.profile_steps < 1:
    parser.error("--batch, --seq_len, --repeats and --profile_steps must be >= 1")
  rows = [row for preset in args.presets
          for row in router_rows(preset, args.batch, args.seq_len, args.repeats,
                                 args.profile_steps if args.profile else 0)]
  print("| preset | B x T | row | ms | / first of its group |\n|---|---|---|---:|---:|")
  for row in rows:
    print(f"| {row['preset']} | {row['batch']} x {row['seq_len']} | {row['row']} |"
          f" {row['ms']:.3f} | {row['vs_first']:.2f} |")
  for row in rows:
    if "profile" in row:
      print("\n" + step_profile.markdown(
          row["profile"], f"{row['preset']} {row['row']}: B {row['batch']}, T {row['seq_len']},"
          f" {row['device']}"))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
