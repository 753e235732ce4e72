"""Where device time goes: run a callable under the JAX profiler and total the accelerator's kernels by name.

Used by the benchmarks (`--profile N`) to name the gap between a measured time and its floor. Reads the XSpace that
`jax.profiler` writes through `jax.profiler.ProfileData`, so it needs no TensorBoard or xprof install. Kernel names
are XLA's (fusions, GEMMs) or a Pallas kernel's `name=`; a CPU run has no device plane and reports nothing.
"""

import collections
import dataclasses
import glob
import tempfile

import jax
from jax.profiler import ProfileData


@dataclasses.dataclass
class KernelTime:
    name: str
    total_us: float
    count: int


def device_kernel_times(fn, scopes: tuple[str, ...] = ()) -> tuple[list[KernelTime], dict[str, float], float]:
    """kernel_times(profile of fn(), scopes); fn must block until its device work is done."""
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        try:
            fn()
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        return kernel_times(ProfileData.from_file(paths[0]), scopes)


def kernel_times(data: ProfileData, scopes: tuple[str, ...] = ()) -> tuple[list[KernelTime], dict[str, float], float]:
    """(kernels sorted by total time, us per scope, device busy us) of a profile's device planes.

    A kernel counts towards the first of `scopes` (JAX named_call / named_scope names) found in its name or its op's
    name stack, else towards "other"."""
    totals, counts, by_scope = collections.defaultdict(float), collections.Counter(), collections.Counter()
    device_lines = [line for plane in data.planes if plane.name.startswith("/device:") for line in plane.lines]
    stream_lines = [line for line in device_lines if line.name.startswith("Stream")]
    if device_lines and not stream_lines:
        print("device_profile: no 'Stream' lines; device lines are", sorted({line.name for line in device_lines}))
    for line in stream_lines:  # one line per CUDA stream holds its kernels; other lines regroup them by op
        for event in line.events:
            totals[event.name] += event.duration_ns / 1e3
            counts[event.name] += 1
            op_name = " ".join(str(value) for key, value in event.stats if key in ("tf_op", "hlo_op", "name"))
            scope = next((s for s in scopes if s in op_name or s in event.name), "other")
            by_scope[scope] += event.duration_ns / 1e3
    kernels = sorted((KernelTime(n, t, counts[n]) for n, t in totals.items()), key=lambda k: -k.total_us)
    return kernels, dict(by_scope), sum(k.total_us for k in kernels)


def print_kernel_table(kernels: list[KernelTime], by_scope: dict[str, float], busy_us: float, top: int, per: int = 1,
                       unit: str = "call") -> None:
    """Scope totals and the top kernels with their share of device busy time, per `per` units (e.g. per forward)."""
    print(f"device busy {busy_us / per:.1f} us per {unit}; by scope: " + ", ".join(
        f"{scope} {us / per:.1f} us ({100 * us / busy_us:.0f}%)" for scope, us in sorted(by_scope.items(),
                                                                                          key=lambda kv: -kv[1])))
    print(f"top {top} kernels:")
    for kernel in kernels[:top]:
        print(f"  {kernel.total_us / per:9.1f} us  {100 * kernel.total_us / busy_us:5.1f}%  "
              f"x{kernel.count / per:<6.1f} {kernel.name[:100]}")
