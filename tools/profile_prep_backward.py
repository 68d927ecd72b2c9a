"""Times the GDN preparation's backward kernels one by one on the GPU (pallas_prepare.py).

For each shape: the preparation kernels' forward and forward + backward, then each backward
kernel alone by launch width, and each again with one of its parts swapped for a cheaper one
(no l2norm backward), to find what their time is spent on.
Inputs are random with the shapes and dtypes of a bf16 training step.

Run on the GPU machine: `python3 tools/profile_prep_backward.py [--shapes 3,0] [--json FILE]`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
from pallas_kernels.benchmarking import median_ms
from pallas_kernels.gated_delta_rule import pallas_prepare, pallas_prepare_kernels
from compare_fla import SHAPES, make_inputs  # tools/ is the script's sys.path[0]

CHUNK = 64

# Parts of the backward kernels that a variant replaces (module globals read at trace time).
VARIANTS = {
    "as_is": {},
    "no_l2norm_backward": {"_l2norm_backward": lambda x, dx, scale, use: dx * scale},
}


@contextlib.contextmanager
def patched(replacements):
  saved = {name: getattr(pallas_prepare_kernels, name) for name in replacements}
  for name, value in replacements.items():
    setattr(pallas_prepare_kernels, name, value)
  try:
    yield
  finally:
    for name, value in saved.items():
      setattr(pallas_prepare_kernels, name, value)


def inputs(seed, batch, seq_len, heads, dim):
  """compare_fla's q, k, v, g, beta `[B,T,H,*]`, and the backward kernels' other inputs."""
  public_inputs = make_inputs(seed, batch, seq_len, heads, dim)
  keys = iter(jax.random.split(jax.random.key(seed + 1000), 16))
  normal = lambda shape, dtype=jnp.bfloat16: jax.random.normal(next(keys), shape).astype(dtype)
  head_major, token = (batch, heads, seq_len, dim), (batch, heads, seq_len)
  x = jnp.tril(0.1 * normal((batch, heads, seq_len // CHUNK, CHUNK, CHUNK), jnp.float32), -1)
  return {
      "q": public_inputs["q"], "k": public_inputs["k"], "v": public_inputs["v"],
      "g_public": public_inputs["g"], "beta_public": public_inputs["beta"],
      "g": jnp.swapaxes(public_inputs["g"], 1, 2),
      "beta": jnp.swapaxes(public_inputs["beta"], 1, 2).astype(jnp.float32),
      "x": (x + jnp.eye(CHUNK)).reshape(batch, heads, seq_len, CHUNK).astype(jnp.bfloat16),
      "dw": normal(head_major), "du": normal(head_major), "dkd": normal(head_major),
      "dqg": normal(head_major), "dp": normal((batch, heads, seq_len, CHUNK)),
      "dk_wy": normal((batch, seq_len, heads, dim), jnp.float32),
      "dcum_wy": normal(token, jnp.float32),
  }


def bench(shape, results, json_path):
  batch, seq_len, heads, dim = shape
  name = f"B{batch} T{seq_len} H{heads} K=V={dim}"
  sets = [inputs(seed, *shape) for seed in (0, 1)]
  timed = lambda fn, names: median_ms(jax.jit(fn), [[s[n] for n in names] for s in sets],
                                      warmup=3, repeats=10, sync=jax.block_until_ready)

  def record(**fields):
    results.append({"shape": name, **fields})
    print(json.dumps(results[-1]), flush=True)
    if json_path:
      with open(json_path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)

  public_names = ("q", "k", "v", "g_public", "beta_public")
  forward = lambda *a: pallas_prepare.prepare_chunks(*a, None, True, CHUNK)

  def forward_backward(*a):
    outputs, vjp = jax.vjp(forward, *a)
    return vjp(outputs)

  record(piece="prep_fwd", ms=timed(forward, public_names))
  record(piece="prep_fwdbwd", ms=timed(forward_backward, public_names))
  for warps in (4, 8):
    static = dict(use_qk_l2norm=True, chunk_size=CHUNK, exact=False,
                  config=pallas_prepare.PrepareConfig(wy_backward_num_warps=warps,
                                                      attention_backward_num_warps=warps))
    for variant, replacements in VARIANTS.items():
      with patched(replacements):
        wy = functools.partial(pallas_prepare.wy_backward, **static)
        attention = functools.partial(pallas_prepare.attention_backward, scale=dim ** -0.5,
                                      **static)
        for piece, fn, names in (
            ("wy_backward", wy, ("k", "v", "g", "beta", "x", "dw", "du")),
            ("attention_backward", attention,
             ("q", "k", "g", "dkd", "dqg", "dp", "dk_wy", "dcum_wy"))):
          try:
            record(piece=piece, warps=warps, variant=variant, ms=timed(fn, names))
          except Exception as error:  # pylint: disable=broad-except
            record(piece=piece, warps=warps, variant=variant,
                   failed=f"{type(error).__name__}: {str(error)[:300]}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", default="3,0", help="indices into SHAPES")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  print(jax.devices()[0].device_kind, flush=True)
  results = []
  for index in args.shapes.split(","):
    bench(SHAPES[int(index)], results, args.json)


if __name__ == "__main__":
  main()
