"""Totalling a profile's device kernels, on a hand-written XSpace (no GPU needed)."""

from jax.profiler import ProfileData

from tools.device_profile import kernel_times

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
