"""The decode-window MoE tiling benchmark: its routing, its checks and its floor (kernels in interpret mode)."""

import jax
import numpy as np

from tools.bench_moe_decode import TINY, Shape, bench, floor_us, make_layers, tilings_around_default


def test_tokens_choose_among_exactly_the_touched_experts_and_layers_differ():
    weights, ids = make_layers(TINY, num_layers=3, touched=12)
    assert len(weights) == 3 and weights[0][0].shape == (TINY.experts, TINY.hidden, 2 * TINY.inter)
    sets = []
    for layer_ids in map(np.asarray, ids):
        assert layer_ids.shape == (TINY.tokens, TINY.top_k)
        assert all(len(set(row)) == TINY.top_k for row in layer_ids)  # a token's experts are distinct
        sets.append(frozenset(layer_ids.ravel()))
        assert len(sets[-1]) == 12
    assert len(set(sets)) == 3
    assert not np.array_equal(np.asarray(weights[0][0]), np.asarray(weights[1][0]))


def test_every_tiling_is_checked_against_the_reference_and_bad_tiles_are_reported():
    # 128 columns exceed the expert width of 64: that tiling must be reported, not crash the run
    tilings = tilings_around_default(TINY, ["32,64,4,2", "128,128,4,3"], ["64,32,4,2"])
    rows = {row["tiling"]: row for row in bench(TINY, tilings, num_layers=1, touched=12, workers=2)}
    assert set(rows) == {"default", "gate_up 32,64,4,2", "gate_up 128,128,4,3", "down 64,32,4,2"}
    assert "failed" in rows["gate_up 128,128,4,3"]
    for name in ("default", "gate_up 32,64,4,2", "down 64,32,4,2"):
        assert 0 < rows[name]["max_error_over_rms"] < 2.0**-5  # bf16 roundings, not a wrong tile
        if jax.default_backend() == "gpu":
            assert rows[name]["moe_gate_up_us"] > 0 and rows[name]["moe_down_us"] > 0
        else:  # no device plane on the CPU: no times, not zeros
            assert rows[name]["moe_gate_up_us"] is None and rows[name]["moe_down_us"] is None
    assert rows["down 64,32,4,2"]["down"] == {"block_n": 64, "block_k": 32, "num_warps": 4, "num_stages": 2}


def test_the_floor_counts_the_touched_and_the_shared_experts():
    floor = floor_us(Shape(), touched=36)  # 37 experts of 2048 x 1024 and 512 x 2048 bf16 over 4.1 TB/s
    assert np.isclose(floor["gate_up"], 37 * 2048 * 1024 * 2 / 4.1e6)
    assert np.isclose(floor["down"], floor["gate_up"] / 2)
