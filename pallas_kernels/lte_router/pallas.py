"""The LTE router's CNN as Pallas (Triton) kernels: every conv layer fused with its neighbours'
elementwise work, forward and backward, one pass over each activation.

The router (reference.py) is, per KV head, L layers xd_l = drop_l(x_{l-1}), pre_l = conv_l(xd_l)
+ b_l, x_l = silu(pre_l) with x_0 = concat(k, v), then logit = x_L . w_p + b_p. XLA runs each of
these as its own pass over HBM (the dropout's hash in several of them), and builds x_0 heads-first
with a transpose, whose gradient is another. Here:

- the first layer reads k and v where they are ([B, T, Hkv, D]), at each tap's offset (masked
  loads; rows outside [0, T) read zeros: the 'same' padding), its dropout from packed keep bits
  that XLA draws once per call (1 bit an element, `packed_keep_bits`, kept for the backward); its
  input-gradient kernel writes dk and dv in that layout, the dropout applied; its weight-gradient
  kernel sums the key and the value channels apart;
- forward, one kernel per later layer: the conv of xd_l from its rows at each tap's offset, the
  bias, and in every forward kernel's epilogue the next layer's dropped input
  xd_{l+1} = drop(silu(pre_l)) with its mask hashed once per element (counter_hash.py: the same
  bits as XLA's mask), or for the last layer the projection's logit;
- backward, one kernel per later layer for the input gradient: the same convolution of d pre_l
  with the taps transposed and their offsets negated, whose epilogue applies layer l's dropout
  mask and the SiLU derivative at pre_{l-1}, writing d pre_{l-1}; one kernel per layer for the
  weight gradient (x[t + offset_i]^T d pre[t] summed per chunk of tokens, the chunks added by
  XLA). The bias gradients, the projection's and the last layer's d pre are XLA reductions and
  one elementwise pass over the narrowest activation.

Files by stage: pallas_forward.py and pallas_backward.py hold the kernels and their launches,
tiling.py what they share (tile sizes, shifted-row loads, dropout bits, block specs); this file
the custom VJP that chains them and the public entry.

The forward keeps pre_l and the first layer's keep bits for the backward (named
ROUTER_ACTIVATION, which the remat policy "attention" saves), so a recomputation runs no
convolution; the backward recomputes xd_l (l > 1) from them in XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels.lte_router import counter_hash, pallas_backward, pallas_forward, tiling
from pallas_kernels.lte_router.reference import ROUTER_ACTIVATION
from pallas_kernels.pallas_common import MIN_DOT_DIM, is_power_of_two


def check_supported(k_BTKD: jax.Array, weights: tuple[jax.Array, ...]) -> None:
  """NotImplementedError for widths, depths and dtypes the kernels do not handle."""
  if len(weights) < 2:
    raise NotImplementedError("lte_router[pallas]: needs at least two conv layers")
  for weight_KICO in weights:
    for name, width in (("input channels", weight_KICO.shape[2]),
                        ("output channels", weight_KICO.shape[3])):
      if width < MIN_DOT_DIM or not is_power_of_two(width):
        raise NotImplementedError(f"lte_router[pallas]: conv {name} {width} must be a power of"
                                  f" two >= {MIN_DOT_DIM}")
  head_dim, c_out = k_BTKD.shape[-1], weights[0].shape[3]
  if (head_dim < MIN_DOT_DIM or 2 * head_dim % 32
      or 2 * head_dim * c_out > tiling.FIRST_LAYER_MAX_ACCUMULATOR):
    raise NotImplementedError(f"lte_router[pallas]: head dim {head_dim} with {c_out} first-layer"
                              " outputs")
  if jnp.dtype(k_BTKD.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
    raise NotImplementedError(f"lte_router[pallas]: dtype {k_BTKD.dtype}")


def packed_keep_bits(seed_words, shape, rate):
  """uint32 [K, B, T, C / 32]: bit j of word w is counter_hash.keep_mask's bit of channel
  32 w + j (seed_words: s0, s1, the row offset, unused)."""
  keep_KBTC = counter_hash.keep_mask(seed_words[:2], shape, rate, layout="KBTC",
                                     row_offset=seed_words[2])
  keep_KBTWJ = keep_KBTC.reshape(*shape[:3], shape[3] // 32, 32).astype(jnp.uint32)
  return jnp.sum(keep_KBTWJ << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)


def _forward(k_BTKD, v_BTKD, words_KBTW, weights, biases, proj_weight_KC, proj_bias_K, seeds,
             dilations, rate):
  """(logit [K, B, T] float32, the pre-activations of the layers)."""
  layer_rate = 0.0 if seeds is None else rate  # every layer's dropout rate
  seed_of = lambda layer: None if seeds is None else seeds[layer]
  pre, xd = pallas_forward.first_forward(
      k_BTKD, v_BTKD, words_KBTW, weights[0], biases[0],
      tiling.offsets(weights[0].shape[1], dilations[0]), layer_rate, seed_of(1), layer_rate)
  pres = [pre]
  for layer in range(1, len(weights)):
    last = layer == len(weights) - 1
    pre, xd = pallas_forward.forward_layer(
        xd, weights[layer], biases[layer],
        tiling.offsets(weights[layer].shape[1], dilations[layer]),
        None if last else seed_of(layer + 1), 0.0 if last else layer_rate,
        (proj_weight_KC, proj_bias_K) if last else None)
    pres.append(pre)
  return xd, pres


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _router_cnn(k_BTKD, v_BTKD, words_KBTW, weights, biases, proj_weight_KC, proj_bias_K, seeds,
                dilations, rate):
  return _forward(k_BTKD, v_BTKD, words_KBTW, weights, biases, proj_weight_KC, proj_bias_K,
                  seeds, dilations, rate)[0]


def _router_cnn_fwd(k_BTKD, v_BTKD, words_KBTW, weights, biases, proj_weight_KC, proj_bias_K,
                    seeds, dilations, rate):
  logit_KBT, pres = _forward(k_BTKD, v_BTKD, words_KBTW, weights, biases, proj_weight_KC,
                             proj_bias_K, seeds, dilations, rate)
  # Kept: the pre-activations. The later layers' dropped inputs are recomputed from them in the
  # backward (one XLA pass each): keeping them too measured slower in the training step, whose
  # layer loop copies every kept activation in and out of its stacked buffers.
  pres = tuple(checkpoint_name(pre, ROUTER_ACTIVATION) for pre in pres)
  return logit_KBT, (k_BTKD, v_BTKD, words_KBTW, pres, weights, biases, proj_weight_KC,
                     proj_bias_K, seeds)


def _router_cnn_bwd(dilations, rate, residuals, dlogit_KBT):
  (k_BTKD, v_BTKD, words_KBTW, pres, weights, biases, proj_weight_KC, proj_bias_K,
   seeds) = residuals
  dtype = pres[0].dtype
  pre_last = pres[-1].astype(jnp.float32)
  act_last = jax.nn.silu(pre_last).astype(dtype).astype(jnp.float32)
  dproj_weight = jnp.einsum("kbt,kbto->ko", dlogit_KBT, act_last)
  dproj_bias = jnp.sum(dlogit_KBT, axis=(1, 2))
  wp = proj_weight_KC.astype(dtype).astype(jnp.float32)
  dpre = ((dlogit_KBT[..., None] * wp[:, None, None, :])
          * tiling.silu_grad(pre_last)).astype(dtype)
  dweights, dbiases = [], []
  layer_rate = 0.0 if seeds is None else rate
  seed_of = lambda layer: None if seeds is None else seeds[layer]
  for layer in reversed(range(len(weights))):
    offsets = tiling.offsets(weights[layer].shape[1], dilations[layer])
    dbiases.append(jnp.sum(dpre.astype(jnp.float32), axis=(1, 2)).astype(biases[layer].dtype))
    if layer == 0:
      dweights.append(pallas_backward.first_weight_grad(
          k_BTKD, v_BTKD, words_KBTW, dpre, offsets, layer_rate).astype(weights[0].dtype))
      dk_BTKD, dv_BTKD = pallas_backward.first_input_grad(dpre, weights[0], words_KBTW, offsets,
                                                          layer_rate)
      break
    xd = pallas_backward.dropped_activation(pres[layer - 1], seed_of(layer), rate)
    dweights.append(pallas_backward.weight_grad(xd, dpre, offsets).astype(weights[layer].dtype))
    dpre = pallas_backward.input_grad(dpre, weights[layer], offsets, pres[layer - 1],
                                      seed_of(layer), layer_rate)
  zero_grad = lambda x: None if x is None else jnp.zeros(x.shape, jax.dtypes.float0)
  return (dk_BTKD.astype(k_BTKD.dtype), dv_BTKD.astype(v_BTKD.dtype), zero_grad(words_KBTW),
          tuple(reversed(dweights)), tuple(reversed(dbiases)),
          dproj_weight.astype(proj_weight_KC.dtype), dproj_bias.astype(proj_bias_K.dtype),
          zero_grad(seeds))


_router_cnn.defvjp(_router_cnn_fwd, _router_cnn_bwd)


def router_logits(k_BTKD, v_BTKD, weights, biases, proj_weight_KC, proj_bias_K, seeds, *,
                  dilations, rate, row_offset=0):
  """logit [B, T, K] float32 of the router's CNN over concat(k, v).

  seeds: uint32 [L, 2], each layer's dropout seed words, or None: no dropout. row_offset: the
  global index of row 0 (see counter_hash.keep_mask)."""
  check_supported(k_BTKD, weights)
  words_KBTW = None
  if seeds is not None:  # per layer: the seed words, the row offset, padding to 4 words
    offsets_L1 = jnp.broadcast_to(jnp.asarray(row_offset).astype(jnp.uint32), (seeds.shape[0], 1))
    seeds = jnp.concatenate([seeds.astype(jnp.uint32), offsets_L1, jnp.zeros_like(offsets_L1)],
                            axis=1)
    batch, length, heads, head_dim = k_BTKD.shape
    # The first layer's keep bits, drawn once and kept for the backward (1 bit an element).
    words_KBTW = checkpoint_name(
        packed_keep_bits(seeds[0], (heads, batch, length, 2 * head_dim), rate), ROUTER_ACTIVATION)
  logit_KBT = _router_cnn(k_BTKD, v_BTKD, words_KBTW, tuple(weights), tuple(biases),
                          proj_weight_KC, proj_bias_K, seeds, tuple(dilations), float(rate))
  # Kept by the remat policy too: the scores' backward (the sigmoid) reads the logits, which a
  # recomputation would otherwise get by running every forward kernel again.
  return jnp.transpose(checkpoint_name(logit_KBT, ROUTER_ACTIVATION), (1, 2, 0))
