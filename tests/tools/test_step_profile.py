"""tools/step_profile.py: HLO parsing and op-class rules on a hand-made module and hand-made
kernel events, the per-step breakdown, and a real traced run on the CPU."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.benchmarking import DeviceEvent
from tests.tools import load_tool

# A GPU-style optimized module: one instruction of each kind the rules tell apart.
HLO = """HloModule jit_train_step, is_scheduled=true, entry_computation_layout={(f32[8,8]{1,0})->f32[8,8]{1,0}}

FileNames
1 "step.py"

%region_add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%a, %b)
}

%gemm_body (p0: bf16[8,8], p1: bf16[8,8]) -> bf16[8,8] {
  %p0 = bf16[8,8]{1,0} parameter(0)
  %p1 = bf16[8,8]{1,0} parameter(1)
  ROOT %dot.2 = bf16[8,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%outer_gemm (q0: bf16[8,8]) -> bf16[8,8] {
  %q0 = bf16[8,8]{1,0} parameter(0)
  ROOT %inner = bf16[8,8]{1,0} fusion(%q0, %q0), kind=kCustom, calls=%gemm_body
}

%reduce_body (r0: f32[8,8]) -> f32[8] {
  %r0 = f32[8,8]{1,0} parameter(0)
  %exp.1 = f32[8,8]{1,0} exponential(%r0)
  %zero = f32[] constant(0)
  ROOT %reduce.1 = f32[8]{0} reduce(%exp.1, %zero), dimensions={1}, to_apply=%region_add
}

%transpose_body (t0: f32[8,8]) -> f32[8,8] {
  %t0 = f32[8,8]{1,0} parameter(0)
  %transpose.1 = f32[8,8]{0,1} transpose(%t0), dimensions={1,0}
  ROOT %copy.1 = f32[8,8]{1,0} copy(%transpose.1)
}

%update_body (u0: f32[64,8], u1: f32[1,8], u2: s32[]) -> f32[64,8] {
  %u0 = f32[64,8]{1,0} parameter(0)
  %u1 = f32[1,8]{1,0} parameter(1)
  %u2 = s32[] parameter(2)
  %zero.2 = s32[] constant(0)
  %neg = f32[1,8]{1,0} negate(%u1)
  ROOT %dus = f32[64,8]{1,0} dynamic-update-slice(%u0, %neg, %u2, %zero.2)
}

%multiply_body (m0: f32[8,8]) -> f32[8,8] {
  %m0 = f32[8,8]{1,0} parameter(0)
  ROOT %multiply.1 = f32[8,8]{1,0} multiply(%m0, %m0)
}

%while_body (w: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %w = (s32[], f32[8,8]{1,0}) parameter(0)
  ROOT %w.out = (s32[], f32[8,8]{1,0}) tuple(%w)
}

%while_cond (c: (s32[], f32[8,8])) -> pred[] {
  %c = (s32[], f32[8,8]{1,0}) parameter(0)
  ROOT %c.out = pred[] constant(true)
}

ENTRY %main.9 (x: f32[8,8]) -> f32[8,8] {
  %x = f32[8,8]{1,0} parameter(0), metadata={op_name="x"}
  %gemm_fusion.1 = bf16[8,8]{1,0} fusion(%x), kind=kCustom, calls=%outer_gemm, metadata={op_name="jit(train_step)/jvp()/dot_general"}, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %custom-call.3 = (bf16[8,8]{1,0}, s8[256]{0}) custom-call(%x, %x), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(train_step)/dot_general"}
  %cudnn-call = (bf16[8,8]{1,0}, u8[0]{0}) custom-call(%x), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(train_step)/dot_product_attention"}
  %custom-call.7 = f32[8,8]{1,0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(train_step)/pallas_call"}, backend_config={name = "masked_attention_fwd", ir = "kind=kLoop calls=%gemm_body"}
  %input_reduce_fusion = f32[8]{0} fusion(%x), kind=kInput, calls=%reduce_body, metadata={op_name="jit(train_step)/reduce_sum"}
  %loss_fusion = f32[8]{0} fusion(%x), kind=kInput, calls=%reduce_body, metadata={op_name="jit(train_step)/while/body/transpose(jvp(cross_entropy_loss))/reduce_sum"}
  %remat_fusion = f32[8,8]{1,0} fusion(%x), kind=kLoop, calls=%multiply_body, metadata={op_name="jit(train_step)/transpose(jvp())/checkpoint/rematted_computation/mul"}
  %remat_dot = f32[8,8]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/transpose(jvp())/checkpoint/rematted_computation/dot_general"}
  %adam_fusion.2 = f32[8,8]{1,0} fusion(%x), kind=kLoop, calls=%multiply_body, metadata={op_name="jit(train_step)/optimizer_update/mul"}
  %adam_copy = f32[8,8]{1,0} copy(%x), metadata={op_name="jit(train_step)/optimizer_update/copy"}
  %loop_multiply_fusion.4 = f32[8,8]{1,0} fusion(%x), kind=kLoop, calls=%multiply_body, metadata={op_name="jit(train_step)/mul"}
  %transpose_fusion = f32[8,8]{1,0} fusion(%x), kind=kLoop, calls=%transpose_body
  %cache = f32[64,8]{1,0} parameter(1)
  %index = s32[] parameter(2)
  %slice.1 = f32[1,8]{1,0} slice(%x), slice={[0:1], [0:8]}
  %dynamic-update-slice_fusion = f32[64,8]{1,0} fusion(%cache, %slice.1, %index), kind=kLoop, calls=%update_body
  %all-reduce.1 = f32[8,8]{1,0} all-reduce(%x), to_apply=%region_add
  %tuple.1 = (s32[], f32[8,8]{1,0}) tuple(%index, %x)
  %while.1 = (s32[], f32[8,8]{1,0}) while(%tuple.1), condition=%while_cond, body=%while_body
  %rng = (u32[2]{0}, u32[8]{0}) custom-call(%index), custom_call_target="cu_threefry2x32"
  ROOT %out = f32[8,8]{1,0} add(%x, %x)
}
"""

EXPECTED = {  # instruction -> class, for a kernel named "kernel"
    "gemm_fusion.1": "matmul", "custom-call.3": "matmul", "cudnn-call": "cuDNN",
    "custom-call.7": "pallas: kernel", "input_reduce_fusion": "XLA: reduction",
    "loss_fusion": "XLA: cross-entropy loss", "remat_fusion": "XLA: remat recompute",
    "remat_dot": "matmul", "adam_fusion.2": "XLA: optimizer update",
    "adam_copy": "copy / transpose",
    "loop_multiply_fusion.4": "XLA: elementwise / loop", "transpose_fusion": "copy / transpose",
    "dynamic-update-slice_fusion": "XLA: slice update / scatter", "slice.1": "copy / transpose",
    "all-reduce.1": "collective", "rng": "other", "out": "XLA: elementwise / loop",
}


@pytest.fixture(scope="module")
def step_profile():
  return load_tool("step_profile")


def test_parse_hlo_reads_opcodes_fusion_bodies_and_metadata(step_profile):
  hlo = step_profile.parse_hlo(HLO)
  assert hlo.name == "jit_train_step"
  gemm = hlo.ops["gemm_fusion.1"]
  assert gemm.opcode == "fusion" and "dot" in gemm.body  # through the nested fusion
  assert hlo.ops["custom-call.3"].target == "__cublas$lt$matmul"  # a tuple-shaped instruction
  assert hlo.ops["custom-call.7"].body == {"custom-call"}  # its IR's "calls=" is not followed
  assert hlo.ops["dynamic-update-slice_fusion"].root == "dynamic-update-slice"
  assert hlo.ops["loss_fusion"].op_name.endswith("transpose(jvp(cross_entropy_loss))/reduce_sum")
  assert hlo.ops["while.1"].opcode == "while" and hlo.ops["dot.2"].opcode == "dot"
  assert hlo.by_kernel_name["loop_multiply_fusion_4"] is hlo.ops["loop_multiply_fusion.4"]
  # Bytes: the result's shape(s) plus each operand's, looked up by name.
  assert gemm.bytes == 128 + 256 and hlo.ops["custom-call.3"].bytes == 128 + 256 + 2 * 256
  assert hlo.ops["dynamic-update-slice_fusion"].bytes == 2 * 2048 + 32 + 4  # whole buffer
  assert hlo.ops["x"].bytes == 0  # a parameter launches nothing
  assert step_profile.shape_bytes("(f32[8]{0}, s4[16]{0}, pred[3], f8e4m3fn[2,2], u16[])") == 49


def test_classify_each_kind_of_instruction(step_profile):
  hlo = step_profile.parse_hlo(HLO)
  assert {name: step_profile.classify(hlo.ops[name], "kernel") for name in EXPECTED} == EXPECTED


@pytest.mark.parametrize("kernel, expected", [
    ("ncclDevKernel_AllGather_RING_LL", "collective"),
    ("MemcpyD2D", "copy / transpose"), ("Memset", "copy / transpose"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "matmul"),
    ("cutlass3x_sm90_tensorop_gemm", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "cuDNN"),
    ("loop_add_fusion", "other"),  # an XLA kernel whose instruction is not in the module
])
def test_classify_by_kernel_name_without_an_instruction(step_profile, kernel, expected):
  assert step_profile.classify(None, kernel) == expected


def test_a_memcpy_under_an_instruction_is_a_copy(step_profile):
  hlo = step_profile.parse_hlo(HLO)
  assert step_profile.classify(hlo.ops["while.1"], "MemcpyD2H") == "copy / transpose"


def event(name, start_us, duration_us, op=None, module="jit_train_step"):
  return DeviceEvent(name=name, start_ns=1e3 * start_us, duration_ns=1e3 * duration_us,
                     hlo_op=op, hlo_module=module if op else None)


def test_breakdown_per_step_times_shares_top_kernels_and_host_gaps(step_profile):
  hlo = step_profile.parse_hlo(HLO)
  events = [  # two steps of 100 us wall each
      event("gemm_kernel", 0, 30, "gemm_fusion.1"),
      event("masked_attention_fwd", 30, 20, "custom-call.7"),
      event("loop_multiply_fusion_4", 60, 10),  # no stat: found by its kernel name
      event("nccl_all_reduce", 65, 10, "all-reduce.1"),  # overlaps the previous kernel by 5 us
      event("gemm_kernel", 100, 30, "gemm_fusion.1"),
      event("masked_attention_fwd", 130, 20, "custom-call.7"),
      event("cublas_gemm_small", 150, 10, "custom-call.3"),
      event("convert_fusion", 180, 4, "fusion.9", module="jit_convert"),  # another program
  ]
  result = step_profile.breakdown(events, hlo, steps=2, wall_s=200e-6,
                                  source=step_profile.GPU_SOURCE)
  assert result["wall_ms"] == pytest.approx(0.1)
  assert result["kernel_ms"] == pytest.approx(0.067)  # 134 us / 2
  assert result["busy_ms"] == pytest.approx(0.0645)  # the union: 5 us of overlap counted once
  assert result["idle_ms"] == pytest.approx(0.1 - 0.0645)
  assert result["span_ms"] == pytest.approx(0.092)  # 0 .. 184 us
  assert result["collective_exposed_ms"] == pytest.approx(0.0025)  # 70 .. 75 us ran alone
  assert result["mapped_share"] == pytest.approx(130 / 134)  # all but the other program's
  rows = {row["class"]: row for row in result["classes"]}
  assert [row["class"] for row in result["classes"]] == [
      "matmul", "pallas: masked_attention_fwd", "XLA: elementwise / loop", "collective",
      "other programs"]
  assert rows["matmul"]["ms"] == pytest.approx(0.035) and rows["matmul"]["launches"] == 1.5
  assert rows["matmul"]["share"] == pytest.approx(70 / 134)
  assert rows["matmul"]["top"] == [
      # bytes: bf16[8,8] out + f32[8,8] in, twice in 60 us; (bf16[8,8], s8[256]) + 2 x f32[8,8]
      {"kernel": "gemm_kernel", "ms": pytest.approx(0.03), "launches": 1.0,
       "op_name": "jit(train_step)/jvp()/dot_general", "gb_per_s": pytest.approx(768 / 60e3)},
      {"kernel": "cublas_gemm_small", "ms": pytest.approx(0.005), "launches": 0.5,
       "op_name": "jit(train_step)/dot_general", "gb_per_s": pytest.approx(896 / 10e3)}]
  assert rows["other programs"]["top"][0]["kernel"] == "convert_fusion"
  # By name-stack word: both GEMMs are dot_generals, the Pallas call and the multiply their own.
  assert result["scopes_ms"] == {"dot_general": pytest.approx(0.035),
                                 "pallas_call": pytest.approx(0.02), "mul": pytest.approx(0.005)}
  table = step_profile.markdown({**result, "device": "/device:GPU:0"}, "a step")
  assert ("| pallas: masked_attention_fwd | 0.020 | 29.9% | 1 | `masked_attention_fwd` 0.020 x1"
          " 0 GB/s |") in table
  assert ("GPU kernels of /device:GPU:0, 2 traced steps: wall 0.10 ms/step, busy 0.06 ms (64%),"
          " idle (host gaps) 0.04 ms") in table
  assert ("By name-stack word (a kernel counts under each word of its stack): `dot_general` 0.035"
          " ms; `pallas_call` 0.020 ms; `mul` 0.005 ms") in table


def test_a_pallas_kernel_in_a_cuda_graph_is_found_by_its_name(step_profile):
  """A kernel run inside a command buffer reports the buffer's instruction; a Pallas kernel is
  then found by the name in its custom call's backend config, with its class and name stack."""
  hlo = step_profile.parse_hlo(HLO)
  assert hlo.by_custom_kernel == {"masked_attention_fwd": hlo.ops["custom-call.7"]}
  result = step_profile.breakdown(
      [event("masked_attention_fwd", 0, 20, "command_buffer_1"),
       event("loop_multiply_fusion_4", 20, 10, "command_buffer_1")],
      hlo, steps=1, wall_s=40e-6, source=step_profile.GPU_SOURCE)
  assert result["mapped_share"] == 1.0
  assert [row["class"] for row in result["classes"]] == [
      "pallas: masked_attention_fwd", "XLA: elementwise / loop"]
  assert result["scopes_ms"] == {"pallas_call": pytest.approx(0.02), "mul": pytest.approx(0.01)}


def test_cpu_thunks_of_control_flow_are_not_counted_twice(step_profile):
  hlo = step_profile.parse_hlo(HLO)
  events = [event("while.1", 0, 50, "while.1"),  # on the CPU: contains its body's thunks
            event("loop_multiply_fusion.4", 10, 20, "loop_multiply_fusion.4")]
  cpu = step_profile.breakdown(events, hlo, steps=1, wall_s=1e-4, source=step_profile.CPU_SOURCE)
  assert [(row["class"], row["ms"]) for row in cpu["classes"]] == [
      ("XLA: elementwise / loop", pytest.approx(0.02))]


def test_profile_step_traces_a_carried_step_on_cpu(step_profile):
  @jax.jit
  def step(x):
    return jnp.tanh(x @ x) + jnp.sum(x, axis=0)

  x = jnp.eye(64)
  hlo_text = step.lower(x).compile().as_text()
  result, carried = step_profile.profile_step(step, x, hlo_text, steps=3, warmup=1)
  expected = x
  for _ in range(4):  # the warm-up call and the three traced ones, each on the last's result
    expected = step(expected)
  assert jnp.allclose(carried, expected)
  assert result["source"] == "CPU thunks" and result["device"] == "/host:CPU"
  assert result["steps"] == 3
  assert result["module"] == hlo_text.split()[1].rstrip(",")
  assert result["mapped_share"] == 1.0
  classes = {row["class"] for row in result["classes"]}
  assert "matmul" in classes and classes <= set(EXPECTED.values())
  assert sum(row["share"] for row in result["classes"]) == pytest.approx(1.0)
  assert 0 < result["busy_ms"] <= result["wall_ms"]


def test_the_models_named_scopes_reach_the_compiled_training_step(step_profile):
  """The named scopes that `scopes_ms` reports for the model's parts survive into the op_name
  metadata of the compiled gradient (forward and backward ops alike), so a profile can attribute
  a step's kernels to norms, MLPs, mixers, gates, the router and the head."""
  from flax import nnx
  from lalte_jax.model import HybridLM
  from lalte_jax.presets import get_model_config
  graphdef, state = nnx.split(HybridLM(get_model_config("lalte-tiny"), rngs=nnx.Rngs(0)))

  def loss(state, tokens_BT):
    return jnp.mean(nnx.merge(graphdef, state)(tokens_BT))

  hlo = step_profile.parse_hlo(jax.jit(jax.grad(loss)).lower(
      state, jnp.zeros((1, 32), jnp.int32)).compile().as_text())
  words = {word for op in hlo.ops.values() for word in op.op_name.replace("(", "/").replace(
      ")", "/").split("/")}
  assert {"rms_norm", "swiglu", "gdn_mixer", "lte_mixer", "gdn_gates", "gdn_output", "lte_router",
          "lm_head"} <= words
  backward = {op.op_name for op in hlo.ops.values() if "transpose(jvp(" in op.op_name}
  assert any("swiglu" in name for name in backward)  # the backward's kernels are named too
