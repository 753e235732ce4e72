"""Totalling a profile's device kernels on hand-written XSpaces, and naming their sources from HLO (no GPU needed)."""

import jax
import jax.numpy as jnp
from jax.profiler import ProfileData

from tools.device_profile import (
    REPOSITORY,
    DeviceIdle,
    KernelTime,
    device_idle,
    hlo_sources,
    host_launch_calls,
    kernel_times,
    print_kernel_table,
    source_of,
)

ATTENTION_OP = 'stats { metadata_id: 1 str_value: "jit(step)/layer/paged_attention/pallas_call" }'
XSPACE = f"""
planes {{
  id: 1 name: "/device:GPU:0"
  lines {{
    id: 1 name: "Stream #7(Compute)"
    events {{ metadata_id: 1 offset_ps: 0 duration_ps: 3000000 {ATTENTION_OP} }}
    events {{ metadata_id: 2 offset_ps: 4000000 duration_ps: 1000000 }}
    events {{ metadata_id: 1 offset_ps: 6000000 duration_ps: 2000000 {ATTENTION_OP} }}
  }}
  lines {{ id: 2 name: "XLA Ops" events {{ metadata_id: 2 offset_ps: 0 duration_ps: 9000000 }} }}
  event_metadata {{ key: 1 value {{ id: 1 name: "paged_block_attention" }} }}
  event_metadata {{ key: 2 value {{ id: 2 name: "gemm_fusion" }} }}
  stat_metadata {{ key: 1 value {{ id: 1 name: "tf_op" }} }}
}}
planes {{
  id: 2 name: "/host:CPU"
  lines {{ id: 1 name: "python" events {{ metadata_id: 1 duration_ps: 99000000 }} }}
  event_metadata {{ key: 1 value {{ id: 1 name: "host work" }} }}
}}
"""


def test_kernels_are_totalled_from_stream_lines_only_and_grouped_by_scope():
    kernels, by_scope, busy_us = kernel_times(ProfileData.from_text_proto(XSPACE), ("paged_attention", "lm_head"))
    assert [(k.name, k.total_us, k.count) for k in kernels] == [("paged_block_attention", 5.0, 2),
                                                                 ("gemm_fusion", 1.0, 1)]
    assert busy_us == 6.0  # the "XLA Ops" line repeats kernels and the host plane is not device time
    assert by_scope == {"paged_attention": 5.0, "other": 1.0}


SECOND_STREAM = """  lines {
    id: 3 name: "Stream #9(Compute)"
    events { metadata_id: 2 offset_ps: 2000000 duration_ps: 2500000 }
    events { metadata_id: 2 offset_ps: 28500000 duration_ps: 2000000 }
  }
"""


def test_device_idle_counts_time_no_stream_runs_and_the_long_gaps():
    # stream 7: [0, 3) [4, 5) [6, 8) us; stream 9: [2, 4.5) and, after a 20.5 us wait, [28.5, 30.5)
    ops_line = '  lines { id: 2 name: "XLA Ops"'
    xspace = XSPACE.replace(ops_line, SECOND_STREAM + ops_line)
    assert xspace != XSPACE
    idle = device_idle(ProfileData.from_text_proto(xspace))
    # busy: [0, 5) [6, 8) [28.5, 30.5); idle: 1 us + 20.5 us, of which one gap >= 10 us
    assert idle == DeviceIdle(span_us=30.5, idle_us=21.5, num_long_gaps=1, long_gap_us=20.5)
    assert device_idle(ProfileData.from_text_proto(XSPACE)) == DeviceIdle(8.0, 2.0, 0, 0.0)


def test_host_launch_calls_are_counted_by_name_from_host_planes_only():
    cupti = """
planes {
  id: 3 name: "/host:CUPTI"
  lines {
    id: 1 name: "Driver API"
    events { metadata_id: 1 duration_ps: 1000 }
    events { metadata_id: 1 offset_ps: 2000 duration_ps: 1000 }
    events { metadata_id: 2 offset_ps: 4000 duration_ps: 1000 }
    events { metadata_id: 3 offset_ps: 6000 duration_ps: 1000 }
  }
  event_metadata { key: 1 value { id: 1 name: "cuLaunchKernelEx" } }
  event_metadata { key: 2 value { id: 2 name: "cuGraphLaunch" } }
  event_metadata { key: 3 value { id: 3 name: "cuMemcpyDtoHAsync" } }
}
"""
    counts = host_launch_calls(ProfileData.from_text_proto(XSPACE + cupti))
    assert counts == {"cuLaunchKernelEx": 2, "cuGraphLaunch": 1}  # no copies, nothing from the device plane
    assert host_launch_calls(ProfileData.from_text_proto(XSPACE)) == {}


def _sine_of(x):
    return jnp.sin(x) * 3.0


def _outer(x):
    return _sine_of(x).sum() + jnp.cos(x).max()


def test_hlo_sources_name_the_python_frames_of_each_instruction():
    text = jax.jit(_outer).lower(jnp.ones(8)).compile().as_text()
    sources = hlo_sources({7: text})
    sine = {name: where for (_, name), where in sources.items() if where.startswith("test_device_profile.py:_sine_of")}
    assert sine and set(sine.values()) == {"test_device_profile.py:_sine_of < test_device_profile.py:_outer"}
    assert all(program == 7 for program, _ in sources)
    # keys are spelled as the profiler names kernels ("_" for "."); the program id picks the executable's dump
    name = next(iter(sine))
    assert "." not in name
    assert source_of(KernelTime(name, 1.0, 1, program_id=7), sources) == sine[name]
    assert source_of(KernelTime(name, 1.0, 1, program_id=8), sources) == ""


def test_hlo_sources_follow_each_frame_to_its_caller():
    """XLA prints a frame's parent as the parent's id + 1 (1: no parent); frame 2 sits between a frame and its real
    caller here, so reading the field as an id names the wrong caller."""
    path = REPOSITORY / "jaxllm" / "models" / "layers.py"
    text = f"""HloModule m

FileNames
1 "{path}"

FunctionNames
1 "outer"
2 "unrelated"
3 "inner"

FileLocations
1 {{file_name_id=1 function_name_id=1 line=10 end_line=10 column=0 end_column=9}}
2 {{file_name_id=1 function_name_id=2 line=20 end_line=20 column=0 end_column=9}}
3 {{file_name_id=1 function_name_id=3 line=30 end_line=30 column=0 end_column=9}}

StackFrames
1 {{file_location_id=1 parent_frame_id=1}}
2 {{file_location_id=2 parent_frame_id=1}}
3 {{file_location_id=3 parent_frame_id=2}}


ENTRY %main (p: f32[8]) -> f32[8] {{
  %p = f32[8]{{0}} parameter(0)
  ROOT %sine.3 = f32[8]{{0}} sine(%p), metadata={{op_name="sin" stack_frame_id=3}}
}}
"""
    assert hlo_sources({1: text}, depth=3) == {(1, "sine_3"): "layers.py:inner < layers.py:outer"}


def test_kernels_of_different_executables_stay_apart_and_sum_by_source(capsys):
    program = 'stats {{ metadata_id: 2 int64_value: {} }}'
    xspace = f"""
planes {{
  id: 1 name: "/device:GPU:0"
  lines {{
    id: 1 name: "Stream #7(Compute)"
    events {{ metadata_id: 1 offset_ps: 0 duration_ps: 3000000 {program.format(11)} }}
    events {{ metadata_id: 1 offset_ps: 4000000 duration_ps: 1000000 {program.format(12)} }}
    events {{ metadata_id: 2 offset_ps: 6000000 duration_ps: 2000000 {program.format(11)} }}
  }}
  event_metadata {{ key: 1 value {{ id: 1 name: "fusion_3" }} }}
  event_metadata {{ key: 2 value {{ id: 2 name: "moe_gate_up" }} }}
  stat_metadata {{ key: 2 value {{ id: 2 name: "program_id" }} }}
}}
"""
    kernels, _, busy_us = kernel_times(ProfileData.from_text_proto(xspace))
    assert [(k.name, k.program_id, k.total_us) for k in kernels] == [("fusion_3", 11, 3.0), ("moe_gate_up", 11, 2.0),
                                                                      ("fusion_3", 12, 1.0)]
    sources = {(11, "fusion_3"): "layers.py:RMSNorm.__call__ < layers.py:DecoderLayer.__call__",
               (12, "fusion_3"): "layers.py:RMSNorm.__call__ < layers.py:Attention.__call__"}
    for kernel in kernels:
        kernel.source = source_of(kernel, sources)
    print_kernel_table(kernels, {}, busy_us, None, top=3)
    summary = capsys.readouterr().out.split("by source function")[1].splitlines()[1:]
    assert [line.split()[0] for line in summary] == ["4.0", "2.0"]  # the two RMSNorm kernels, then the Pallas one
    assert summary[0].endswith("layers.py:RMSNorm.__call__") and summary[1].endswith("moe_gate_up")


def test_the_table_reports_idle_time_and_host_launches_per_unit(capsys):
    idle = DeviceIdle(span_us=100.0, idle_us=30.0, num_long_gaps=2, long_gap_us=24.0,
                      host_launches={"cuGraphLaunch": 4, "cuLaunchKernelEx": 10})
    print_kernel_table([], {}, 70.0, idle, top=0, per=2, unit="forward")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("device idle 15.0 us per forward of 50.0 us") and "12.0 us of it in 1.0 gaps" in lines[0]
    assert lines[1] == "host launch calls per forward: cuLaunchKernelEx 5.0, cuGraphLaunch 2.0"
