"""Which MoE tiling streams the experts fastest in one decode window (LLaDA2.0-mini shapes, batch 1).

A denoise window's tokens are mostly [MASK]s and route alike: at batch 1 LLaDA2 touches ~35 of its 256 experts per
layer (engine runs 13-14), not the ~163 that independent tokens would. So the tokens here take their top-8 from a
fixed set of `--touched` experts (token t the top_k after t * top_k in a cycle through that set, so every one of
them is used), the shared expert rides in the kernels as in the engine, and `--layers` layers of
distinct weights run unrolled in one jit (the L2 cache holds none of them). Each kernel's device time per layer comes
from the profiler; each tiling's output is checked against the float32 reference on the first layer.

    python -m tools.bench_moe_decode                                   # the default sweep, on a GPU
    python -m tools.bench_moe_decode --gate-up 64,64,4,4 32,128,4,3 --down 128,64,4,3

A tiling is block_n,block_k,num_warps,num_stages; --gate-up tilings run with the default down tiles and the other
way round. Without a GPU the kernels run in interpret mode (use --tiny: minutes at full size) and report no times.
"""

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels.moe import GemmTiles, MoeTiles, default_tiles, moe_experts
from tools.bench_moe import compile_all
from tools.bench_offline import COPY_BANDWIDTH
from tools.device_profile import device_kernel_times


@dataclasses.dataclass(frozen=True)
class Shape:
    experts: int = 256
    hidden: int = 2048
    inter: int = 512
    top_k: int = 8
    tokens: int = 32


TINY = Shape(experts=64, hidden=128, inter=64)
# around the default: the previous gate/up default (128 x 128, one block per SM) first, then finer tiles and more
# blocks per SM (the 64 x 64 x 4-stage default won engine run 14); down tiles for two or three blocks per SM
DEFAULT_GATE_UP = ["128,128,4,3", "64,128,4,2", "32,128,4,3", "32,64,4,4", "64,64,8,4", "128,64,4,3"]
DEFAULT_DOWN = ["128,64,4,3", "64,128,4,3", "256,64,4,2", "128,128,4,2", "64,64,4,4"]


def parse_tiles(spec: str) -> GemmTiles:
    return GemmTiles(*(int(part) for part in spec.split(",")))


def make_layers(shape: Shape, num_layers: int, touched: int, seed: int = 0):
    """Per layer: (w_gate_up [E, H, 2I], w_down [E, I, H], shared gate/up [H, 2I], shared down [I, H]) in bf16 and
    expert ids i32[T, top_k], token t taking `top_k` consecutive experts of a random touched set (all of them used)."""
    if not shape.top_k <= touched <= shape.experts:
        raise ValueError(f"--touched must lie in [{shape.top_k}, {shape.experts}], got {touched}")
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.key(seed), 4 * num_layers)
    init = lambda key, rows, cols, *lead: (  # noqa: E731
        jax.random.normal(key, (*lead, rows, cols), jnp.float32) / np.sqrt(rows)).astype(jnp.bfloat16)
    weights, ids = [], []
    for layer in range(num_layers):
        k = keys[4 * layer:4 * layer + 4]
        weights.append((init(k[0], shape.hidden, 2 * shape.inter, shape.experts),
                        init(k[1], shape.inter, shape.hidden, shape.experts),
                        init(k[2], shape.hidden, 2 * shape.inter), init(k[3], shape.inter, shape.hidden)))
        chosen = rng.choice(shape.experts, touched, replace=False)
        picks = (np.arange(shape.tokens)[:, None] * shape.top_k + np.arange(shape.top_k)) % touched
        ids.append(jnp.asarray(chosen[picks], jnp.int32))
    return weights, ids


def layer_stack(tiles: MoeTiles, interpret: bool):
    def layers(x, weights, ids, gate_weights):  # weights as arguments: closed over, they would be HLO constants
        for (w_gate_up, w_down, shared_gate_up, shared_down), layer_ids in zip(weights, ids):
            x = moe_experts(x, layer_ids, gate_weights, w_gate_up, w_down, impl="pallas", interpret=interpret,
                            tiles=tiles, shared=(shared_gate_up, shared_down))
        return x
    return layers


def reference_error(out, x, weights, ids, gate_weights) -> float:
    """max |out - float32 reference| / rms(reference) for the first layer."""
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    w_gate_up, w_down, shared_gate_up, shared_down = map(f32, weights[0])
    ref = moe_experts(f32(x), ids[0], gate_weights, w_gate_up, w_down, impl="reference",
                      shared=(shared_gate_up, shared_down))
    return float(jnp.max(jnp.abs(f32(out) - ref)) / jnp.sqrt(jnp.mean(ref**2)))


def floor_us(shape: Shape, touched: int) -> dict[str, float]:
    """Bytes of the touched and shared experts' weights per layer over the copy ceiling."""
    experts = touched + 1
    return {"gate_up": 1e6 * experts * shape.hidden * 2 * shape.inter * 2 / COPY_BANDWIDTH,
            "down": 1e6 * experts * shape.inter * shape.hidden * 2 / COPY_BANDWIDTH}


def tilings_around_default(shape: Shape, gate_up_specs, down_specs) -> dict[str, MoeTiles]:
    base = default_tiles(shape.tokens, shape.top_k, shape.experts, shape.hidden, shape.inter)
    found = {"default": base}
    for spec in gate_up_specs:
        found[f"gate_up {spec}"] = dataclasses.replace(base, gate_up=parse_tiles(spec))
    for spec in down_specs:
        found[f"down {spec}"] = dataclasses.replace(base, down=parse_tiles(spec))
    return found


def bench(shape: Shape, tilings: dict[str, MoeTiles], num_layers: int, touched: int, repeats: int = 5,
          workers: int = 16) -> list[dict]:
    """One row per tiling: device us per layer of each kernel (None without a GPU), the first layer's error."""
    interpret = jax.default_backend() != "gpu"
    weights, ids = make_layers(shape, num_layers, touched)
    x = jax.random.normal(jax.random.key(1), (shape.tokens, shape.hidden), jnp.bfloat16)
    gate_weights = jnp.full((shape.tokens, shape.top_k), 1.0 / shape.top_k, jnp.float32)
    args = (x, weights, ids, gate_weights)
    first_layer_args = (x, weights[:1], ids[:1], gate_weights)
    jobs = {}
    for name, tiles in tilings.items():  # compiled in parallel: all layers to time, the first alone to check
        jobs[name] = (layer_stack(tiles, interpret), args)
        jobs[(name, "check")] = (layer_stack(tiles, interpret), first_layer_args)
    compiled = compile_all(jobs, workers)
    rows = []
    for name in tilings:
        executable, check = compiled[name], compiled[(name, "check")]
        row = {"tiling": name, **dataclasses.asdict(tilings[name])}
        failure = next((e for e in (executable, check) if isinstance(e, Exception)), None)
        if failure is not None:  # e.g. tiles that do not divide the widths, or need more shared memory than an SM has
            rows.append(row | {"failed": f"{type(failure).__name__}: {str(failure)[:200]}"})
            continue
        row["max_error_over_rms"] = reference_error(check(*first_layer_args), *args)
        executable(*args).block_until_ready()

        def timed(executable=executable):
            return [executable(*args) for _ in range(repeats)][-1].block_until_ready()

        kernels, _, _, _ = device_kernel_times(timed)
        for kernel in ("moe_gate_up", "moe_down"):  # None where the profile has no such kernel (no GPU)
            matching = [k.total_us for k in kernels if kernel in k.name]
            row[f"{kernel}_us"] = sum(matching) / (repeats * num_layers) if matching else None
        rows.append(row)
    return rows


def print_table(rows: list[dict], floor: dict[str, float]) -> None:
    print(f"| tiling | gate/up us (floor {floor['gate_up']:.1f}) | down us (floor {floor['down']:.1f}) | "
          "max error / rms |")
    print("|---|---:|---:|---:|")
    us = lambda value: "-" if value is None else f"{value:.1f}"  # noqa: E731
    for row in rows:
        if "failed" in row:
            print(f"| {row['tiling']} | failed: {row['failed'][:80]} | | |")
        else:
            print(f"| {row['tiling']} | {us(row['moe_gate_up_us'])} | {us(row['moe_down_us'])} | "
                  f"{row['max_error_over_rms']:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--touched", type=int, default=36, help="experts the window's tokens choose from, per layer")
    parser.add_argument("--layers", type=int, default=8, help="layers of distinct weights in one jit")
    parser.add_argument("--gate-up", nargs="*", default=None, metavar="N,K,WARPS,STAGES",
                        help="gate/up tilings to time beside the default (default: a sweep)")
    parser.add_argument("--down", nargs="*", default=None, metavar="N,K,WARPS,STAGES",
                        help="down tilings to time beside the default (default: a sweep)")
    parser.add_argument("--tiny", action="store_true", help="64 experts of width 64, hidden 128 (a CPU check)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    shape = TINY if args.tiny else Shape()
    touched = min(args.touched, shape.experts)
    explicit = args.gate_up is not None or args.down is not None
    tilings = tilings_around_default(shape, (args.gate_up or []) if explicit else DEFAULT_GATE_UP,
                                     (args.down or []) if explicit else DEFAULT_DOWN)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; {shape}, {touched} experts touched, "
          f"{args.layers} layers", flush=True)
    rows = bench(shape, tilings, args.layers, touched)
    print_table(rows, floor_us(shape, touched))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
