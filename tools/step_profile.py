"""Per-op-class GPU time of one jitted step (`--profile` of tools/bench_train.py and
tools/bench_decode.py).

`profile_step` traces a few steps after warm-up (`pallas_kernels.benchmarking.traced_passes`),
maps each GPU kernel to the HLO instruction it ran (the event's `hlo_op` stat; without one, or
with a CUDA graph's instead, the kernel name, which XLA derives from the instruction's name, or a
Pallas call's `name=` in its custom call's backend config) and classifies the instruction from
the compiled step's HLO text (`compiled.as_text()`: opcode, the opcodes a fusion holds,
custom_call_target, op_name metadata), first rule that applies:

- `collective`: NCCL kernels and collective instructions;
- `copy / transpose`: memcpy and memset, copies, transposes and fusions that only move or fill
  data (a whole cache that a decode step copies shows here);
- `pallas: NAME`: our Pallas kernels (Triton / Mosaic GPU custom calls), one class per kernel;
- `cuDNN`: cuDNN custom calls (attention);
- `matmul`: cuBLAS / cuBLASLt custom calls, dots and fusions that hold one (Triton and cuDNN
  GEMM fusions);
- `XLA: optimizer update`, `XLA: cross-entropy loss`: other fusions under the train step's
  `optimizer_update` / `cross_entropy_loss` named scopes;
- `XLA: remat recompute`: other fusions of jax.checkpoint's recomputation (`rematted_computation`
  in their op_name);
- `XLA: reduction`, `XLA: slice update / scatter` (dynamic-update-slice in place, scatter),
  `XLA: elementwise / loop`: the remaining instructions by what their fusion holds;
- `other`: custom calls of other targets and kernels without an HLO instruction;
  `other programs`: kernels of another compiled program that ran during the trace.

Each top kernel also gets `gb_per_s`: its instruction's operand and result bytes (from the
shapes in the HLO: what one launch moves at most, XLA's bytes-accessed estimate; an in-place
update counts its whole buffer) over its time, to set a memory-bound kernel against the copy
bandwidth. Per step also the time under each word of the kernels' jax name stacks (`scopes_ms`: the
model's named scopes - `rms_norm`, `swiglu`, `<kind>_mixer` per block, `gdn_gates`,
`gdn_output`, `lte_router`, `lm_head` - jitted functions such as `masked_attention`, primitives),
the largest first: where in the model the time goes, across classes.

Per step: the wall time, the GPU busy time (the union of the kernels' intervals), the idle time
(wall - busy: host dispatch and launch gaps), the GPU span (first kernel start to last kernel
end), the exposed collective time (busy time in which only collectives ran: what overlapping them
with compute could still save) and, per class, the time, its share of the summed kernel time and
its top kernels. The profiler adds its own cost to every launch and makes XLA launch kernels
one by one instead of as CUDA graphs (unless --xla_enable_command_buffers_during_profiling), so
compare the wall with the untraced step time: the difference is the tracing's. With several
devices, the first device's kernels are counted (each runs the same SPMD step).

On the CPU the XLA thunks of the host threads stand in for the kernels (same classification).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import jax

from pallas_kernels.benchmarking import DeviceEvent, Timed, device_events, traced_passes

COLLECTIVE_OPCODES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                      "collective-permute", "collective-broadcast", "ragged-all-to-all")
# Instructions that only move, reshape or fill data (and the structure around them in a fusion).
MOVE_OPCODES = frozenset({"copy", "copy-start", "copy-done", "transpose", "bitcast", "reshape",
                          "slice", "dynamic-slice", "concatenate", "pad", "broadcast", "iota",
                          "parameter", "constant", "tuple", "get-tuple-element"})
REDUCE_OPCODES = frozenset({"reduce", "reduce-window"})
UPDATE_OPCODES = frozenset({"dynamic-update-slice", "scatter"})
# Control flow: on the CPU their thunks contain the thunks of their bodies, which count already
# (on a GPU, a kernel under one is the copy of a loop's predicate).
CONTAINER_OPCODES = frozenset({"while", "conditional", "call"})
PALLAS_TARGETS = ("triton", "mosaic")  # __gpu$xla.gpu.triton, triton_kernel_call, mosaic_gpu*
SCOPE_CLASSES = (("optimizer_update", "XLA: optimizer update"),
                 ("cross_entropy_loss", "XLA: cross-entropy loss"),
                 ("rematted_computation", "XLA: remat recompute"))
GEMM_KERNEL = re.compile(r"gemm|cublas|cutlass|nvjet|xmma", re.IGNORECASE)
TOP_KERNELS = 20  # per class in the JSON result; the markdown table shows the first TABLE_KERNELS
TABLE_KERNELS = 5
TABLE_SCOPES = 15  # name-stack words in the markdown summary
OP_NAME_CHARS = 160  # of a top kernel's jax name stack, kept in the JSON result
UNMAPPED_SAMPLE = 10  # kernels without an instruction, listed in the result to show why
SCOPE_TOTALS = 40  # names of the jax name stack with the most GPU time, in the JSON result
# Name-stack words that every kernel of a step carries: no information about where time goes.
_STACK_WORDS = frozenset({"jit", "jvp", "transpose", "while", "body", "cond", "eval_jaxpr",
                          "train_step", "pjit", "checkpoint", "remat", "custom_jvp_call",
                          "custom_vjp_call", "shard_map"})
GPU_SOURCE, CPU_SOURCE = "GPU kernels", "CPU thunks"


@dataclasses.dataclass(frozen=True)
class HloOp:
  """What the classification needs of one instruction of the compiled HLO."""
  name: str
  opcode: str
  op_name: str = ""  # metadata op_name: jax's name stack ("jit(f)/transpose(jvp())/...")
  target: str = ""  # custom_call_target
  body: frozenset[str] = frozenset()  # opcodes inside a fusion, nested fusions included
  root: str = ""  # the opcode of a fusion's root (the instruction's own otherwise)
  bytes: int = 0  # its operands' and result's bytes: what one launch moves at most (estimate)


@dataclasses.dataclass(frozen=True)
class HloModule:
  name: str
  ops: dict[str, HloOp]  # instruction name -> op, every computation's
  by_kernel_name: dict[str, HloOp]  # the same under XLA's kernel names ('.' and '-' as '_')
  # Custom calls by the kernel name in their backend config (a Pallas call's `name=`), the first
  # of each name: a kernel that runs inside a CUDA graph reports the graph's instruction
  # ("command_buffer_1"), not its own, and is found by its name.
  by_custom_kernel: dict[str, HloOp] = dataclasses.field(default_factory=dict)


_HEADER = re.compile(r"(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\{\s*$")  # "%name (params) -> shape {"
_INSTRUCTION = re.compile(r"\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")  # "  %name = shape opcode(..."
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_CALLS = r"\bcalls=%?([\w.\-]+)"
# A custom call's kernel name in its backend config: `name = "k"` (typed FFI attributes, as the
# Pallas Triton calls print) or `"name":"k"` (JSON).
_KERNEL_NAME = r'(?:^|[\s{,])(?:name\s*=\s*|"name"\s*:\s*)"([^"\\]+)"'

_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8e\w+|c64|c128)\[([\d,]*)\]")  # "bf16[8,128]"
_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}  # others: the number in the name


def _opcode(rest: str) -> tuple[str, str, str]:
  """(result shape, opcode, the text after `opcode(`) of an instruction's text after '='."""
  depth, index = 0, 0
  if rest.startswith("("):  # a tuple shape: up to its closing parenthesis
    for index, char in enumerate(rest):
      depth += {"(": 1, ")": -1}.get(char, 0)
      if depth == 0:
        break
  start = rest.find(" ", index)
  match = _OPCODE.match(rest, start) if start >= 0 else None
  return (rest[:start], match.group(1), rest[match.end():]) if match else ("", "", rest)


def shape_bytes(text: str) -> int:
  """Bytes of every array shape written in `text` (a shape, a tuple of shapes, operands)."""
  total = 0
  for dtype, dims in _ARRAY.findall(text):
    bits = _BITS.get(dtype) or (8 if dtype.startswith("f8") else int(dtype[1:]))
    count = 1
    for dim in filter(None, dims.split(",")):
      count *= int(dim)
    total += count * bits // 8
  return total


def _operands(arguments: str) -> list[str]:
  """The operand texts of `opcode(` + arguments: up to the matching ')', split at depth 0."""
  depth, current, operands = 0, [], []
  for char in arguments:
    if char in "([{":
      depth += 1
    elif char in ")]}":
      if depth == 0:
        break
      depth -= 1
    if char == "," and depth == 0:
      operands.append("".join(current).strip())
      current = []
    else:
      current.append(char)
  operands.append("".join(current).strip())
  return [operand for operand in operands if operand]


def _attribute(pattern: str, text: str) -> str:
  match = re.search(pattern, text)
  return match.group(1) if match else ""


# Instructions that launch nothing by themselves (no bytes estimate).
_NO_KERNEL = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast"})


def parse_hlo(text: str) -> HloModule:
  """The instructions of an HLO module's text (`compiled.as_text()`), fusion bodies resolved and
  each instruction's bytes estimated from its operands' and result's shapes."""
  module = _attribute(r"^HloModule\s+([\w.\-]+)", text)
  # computation -> [(name, shape, opcode, attributes, root)]
  computations: dict[str, list[tuple[str, str, str, str, bool]]] = {}
  current = None
  for line in text.splitlines():
    if not line.startswith((" ", "\t")):
      header = _HEADER.match(line)
      current = computations.setdefault(header.group(1), []) if header else None
      continue
    instruction = _INSTRUCTION.match(line)
    if current is not None and instruction:
      shape, opcode, attributes = _opcode(instruction.group(3))
      current.append((instruction.group(2), shape, opcode, attributes,
                      bool(instruction.group(1))))

  def body(computation: str) -> tuple[frozenset[str], str]:
    """(opcodes, root opcode) of a fused computation; nested fusions' opcodes included."""
    opcodes, root = set(), ""
    for _, _, opcode, attributes, is_root in computations.get(computation, ()):
      opcodes.add(opcode)
      if opcode == "fusion":
        opcodes |= body(_attribute(_CALLS, attributes))[0]
      root = opcode if is_root else root
    return frozenset(opcodes), root

  ops, by_custom_kernel = {}, {}
  for instructions in computations.values():
    result_bytes = {name: shape_bytes(shape) for name, shape, *_ in instructions}
    for name, shape, opcode, attributes, _ in instructions:
      fused, root = (body(_attribute(_CALLS, attributes)) if opcode == "fusion"
                     else (frozenset({opcode}), opcode))
      moved = 0
      if opcode not in _NO_KERNEL:  # operands written with their shape, or by name
        moved = result_bytes[name] + sum(
            shape_bytes(operand) or result_bytes.get(operand.split()[-1].lstrip("%"), 0)
            for operand in _operands(attributes))
      ops[name] = HloOp(
          name=name, opcode=opcode, op_name=_attribute(r'\bop_name="([^"]*)"', attributes),
          target=_attribute(r'\bcustom_call_target="([^"]*)"', attributes), body=fused,
          root=root, bytes=moved)
      kernel = _attribute(_KERNEL_NAME, attributes) if opcode == "custom-call" else ""
      if kernel:
        by_custom_kernel.setdefault(kernel, ops[name])
  by_kernel_name = {re.sub(r"[.\-]", "_", name): op for name, op in ops.items()}
  return HloModule(name=module, ops=ops, by_kernel_name=by_kernel_name,
                   by_custom_kernel=by_custom_kernel)


def classify(op: HloOp | None, kernel: str) -> str:
  """The class of a kernel named `kernel` that ran the instruction `op` (None: not found)."""
  lowered = kernel.lower()
  if lowered.startswith("nccl") or (op is not None and op.opcode.startswith(COLLECTIVE_OPCODES)):
    return "collective"
  if lowered.startswith(("memcpy", "memset")):
    return "copy / transpose"
  if op is None:  # no instruction: what the kernel's name tells
    if "cudnn" in lowered:
      return "cuDNN"
    return "matmul" if GEMM_KERNEL.search(kernel) else "other"
  if op.opcode == "custom-call":
    target = op.target.lower()
    if any(name in target for name in PALLAS_TARGETS):
      return f"pallas: {kernel}"
    if "cudnn" in target:
      return "cuDNN"
    return "matmul" if ("cublas" in target or "gemm" in target) else "other"
  if op.body & {"dot", "convolution"}:
    return "matmul"
  if op.body <= MOVE_OPCODES:
    return "copy / transpose"
  for scope, name in SCOPE_CLASSES:
    # A scope is one level of the name stack, or wrapped by autodiff: "transpose(jvp(scope))".
    if re.search(rf"(^|[/(]){scope}($|[/)])", op.op_name):
      return name
  if op.body & REDUCE_OPCODES:
    return "XLA: reduction"
  if op.root in UPDATE_OPCODES:
    return "XLA: slice update / scatter"
  return "XLA: elementwise / loop"


def _instruction(hlo: HloModule, event: DeviceEvent) -> HloOp | None:
  """The instruction a kernel ran: its `hlo_op` stat as written in the HLO text or in XLA's
  kernel-name spelling, else the kernel's own name (XLA names kernels after instructions)."""
  if event.hlo_op:
    name = event.hlo_op.lstrip("%")
    op = hlo.ops.get(name) or hlo.by_kernel_name.get(re.sub(r"[.\-]", "_", name))
    if op is not None and not (op.opcode in CONTAINER_OPCODES
                               and event.name in hlo.by_custom_kernel):
      return op
  return hlo.by_kernel_name.get(event.name) or hlo.by_custom_kernel.get(event.name)


def _union_ns(events: list[DeviceEvent]) -> float:
  """Length of the union of the events' [start, end) intervals."""
  total, end = 0.0, float("-inf")
  for event in sorted(events, key=lambda e: e.start_ns):
    stop = event.start_ns + event.duration_ns
    if stop > end:
      total += stop - max(event.start_ns, end)
      end = stop
  return total


def breakdown(events: list[DeviceEvent], hlo: HloModule, *, steps: int, wall_s: float,
              source: str) -> dict:
  """Per-step times by class of `steps` traced steps (see the module doc); a JSON-ready dict."""
  steps_of_module = any(e.hlo_module == hlo.name for e in events)
  classes: dict[str, dict[str, list[float]]] = {}  # class -> kernel -> [launches, ns, bytes]
  counted, mapped_ns, unmapped, op_names = [], 0.0, {}, {}
  scope_ns: dict[str, float] = {}  # name-stack word -> GPU time of the kernels under it
  not_collective = []  # the kernels that a collective can overlap with
  for event in events:
    op = _instruction(hlo, event)
    if source == CPU_SOURCE and op is not None and op.opcode in CONTAINER_OPCODES:
      continue
    if steps_of_module and event.hlo_module not in (None, hlo.name):
      name = "other programs"  # another jitted computation that ran inside the traced steps
    else:
      name = classify(op, event.name)
      mapped_ns += event.duration_ns if op is not None else 0.0
      if op is None and len(unmapped) < UNMAPPED_SAMPLE:
        unmapped.setdefault(event.name, {"kernel": event.name, "hlo_op": event.hlo_op,
                                         "hlo_module": event.hlo_module})
    kernel = classes.setdefault(name, {}).setdefault(event.name, [0, 0.0, 0])
    kernel[0] += 1
    kernel[1] += event.duration_ns
    kernel[2] += op.bytes if op is not None else 0
    if op is not None and op.op_name:
      op_names.setdefault(event.name, op.op_name[:OP_NAME_CHARS])
    if op is not None and name != "other programs":
      for word in set(re.findall(r"[A-Za-z_]\w*", op.op_name)) - _STACK_WORDS:
        scope_ns[word] = scope_ns.get(word, 0.0) + event.duration_ns
    counted.append(event)
    if name != "collective":
      not_collective.append(event)
  kernel_ns = sum(e.duration_ns for e in counted)
  if not kernel_ns:
    raise RuntimeError(f"no {source} event of the step's program {hlo.name!r} took any time")
  per_step_ms = lambda ns: ns / 1e6 / steps
  rows = []
  for name, kernels in classes.items():
    ranked = sorted(kernels.items(), key=lambda item: item[1][1], reverse=True)
    class_ns = sum(ns for _, ns, _ in kernels.values())
    rows.append({"class": name, "ms": per_step_ms(class_ns), "share": class_ns / kernel_ns,
                 "launches": sum(n for n, _, _ in kernels.values()) / steps,
                 "top": [{"kernel": kernel, "ms": per_step_ms(ns), "launches": n / steps,
                          "op_name": op_names.get(kernel, ""),
                          # the operands' and result's bytes over the time: how far a
                          # memory-bound kernel is from the copy bandwidth (bytes per ns = GB/s)
                          "gb_per_s": moved / ns if moved and ns else None}
                         for kernel, (n, ns, moved) in ranked[:TOP_KERNELS]]})
  rows.sort(key=lambda row: row["ms"], reverse=True)
  busy_ns = _union_ns(counted)
  busy_ms, wall_ms = per_step_ms(busy_ns), 1e3 * wall_s / steps
  span_ns = (max(e.start_ns + e.duration_ns for e in counted) - min(e.start_ns for e in counted))
  return {"source": source, "module": hlo.name, "steps": steps, "wall_ms": wall_ms,
          "busy_ms": busy_ms, "idle_ms": wall_ms - busy_ms, "span_ms": per_step_ms(span_ns),
          "collective_exposed_ms": per_step_ms(busy_ns - _union_ns(not_collective)),
          "kernel_ms": per_step_ms(kernel_ns), "mapped_share": mapped_ns / kernel_ns,
          "unmapped_sample": list(unmapped.values()), "classes": rows,
          # Where in the model the time goes: each word of the jax name stacks (named scopes,
          # jitted functions, primitives), the time of every kernel whose stack holds it.
          "scopes_ms": {word: per_step_ms(ns) for word, ns in sorted(
              scope_ns.items(), key=lambda item: item[1], reverse=True)[:SCOPE_TOTALS]}}


def _profiler_options():
  """JAX's trace options without Python function events, which would add host time to every
  step (None, JAX's defaults, where this JAX has no ProfileOptions)."""
  options_class = getattr(jax.profiler, "ProfileOptions", None)
  if options_class is None:
    return None
  options = options_class()
  options.python_tracer_level = 0
  return options


def profile_step(step: Callable[[Any], Any], carry: Any, hlo_text: str, *, steps: int,
                 warmup: int = 1) -> tuple[dict, Any]:
  """(`breakdown` of `steps` traced calls of `step`, the last carry).

  step: carry -> carry, one jitted step that consumes its state (e.g. donated) and returns the
    next; each call is waited for. hlo_text: the step's compiled HLO (`compiled.as_text()`).
  """
  carried = [carry]

  def one_step():
    carried[0] = step(carried[0])
    return carried[0]

  profile, wall_s = traced_passes(Timed(one_step, [()]), passes=steps, warmup=warmup,
                                  profiler_options=_profiler_options())
  on_cpu = jax.default_backend() == "cpu"
  source = CPU_SOURCE if on_cpu else GPU_SOURCE
  events = device_events(profile, cpu_thunks=on_cpu)
  if not events:
    raise RuntimeError(f"the profile has no {source} (no CUPTI in this environment?); planes: "
                       + ", ".join(p.name for p in profile.planes))
  first = min(e.plane for e in events)  # every device runs the same (SPMD) step: count one
  result = breakdown([e for e in events if e.plane == first], parse_hlo(hlo_text), steps=steps,
                     wall_s=wall_s, source=source)
  return {**result, "device": first}, carried[0]


def markdown(result: dict, title: str) -> str:
  """A `breakdown` as a heading, a summary line and a table (for docs/benchmarks.md)."""
  lines = [
      f"#### {title}", "",
      f"{result['source']} of {result['device']}, {result['steps']} traced steps: wall {result['wall_ms']:.2f} ms/step,"
      f" busy {result['busy_ms']:.2f} ms ({result['busy_ms'] / result['wall_ms']:.0%}), idle"
      f" (host gaps) {result['idle_ms']:.2f} ms, span {result['span_ms']:.2f} ms, collectives"
      f" alone {result.get('collective_exposed_ms', 0.0):.2f} ms, kernel sum"
      f" {result['kernel_ms']:.2f} ms; {result['mapped_share']:.0%} of the kernel time mapped to"
      f" an HLO instruction of {result['module']}.", "",
      "| class | ms / step | % of kernel time | launches / step |"
      " top kernels (ms / step x launches) |", "|---|---:|---:|---:|---|"]
  for row in result["classes"]:
    top = "; ".join(f"`{k['kernel'][:60]}` {k['ms']:.3f} x{k['launches']:g}"
                    + (f" {k['gb_per_s']:,.0f} GB/s" if k.get("gb_per_s") else "")
                    for k in row["top"][:TABLE_KERNELS])
    lines.append(f"| {row['class']} | {row['ms']:.3f} | {row['share']:.1%} |"
                 f" {row['launches']:g} | {top} |")
  scopes = list(result.get("scopes_ms", {}).items())[:TABLE_SCOPES]
  if scopes:
    lines += ["", "By name-stack word (a kernel counts under each word of its stack): "
              + "; ".join(f"`{word}` {ms:.3f} ms" for word, ms in scopes)]
  return "\n".join(lines)
