"""Where device time goes: run a callable under the JAX profiler and total the accelerator's kernels by name.

Used by the benchmarks (`--profile N`) to name the gap between a measured time and its floor. Reads the XSpace that
`jax.profiler` writes through `jax.profiler.ProfileData`, so it needs no TensorBoard or xprof install. Kernel names
are XLA's (fusions, GEMMs) or a Pallas kernel's `name=`; a CPU run has no device plane and reports nothing.

Inside XLA's command buffers a kernel carries no JAX name stack, so scopes cannot say where it came from. Given the
optimized HLO that XLA dumps (`XLA_FLAGS=--xla_dump_to=DIR`, see `hlo_dump_flags`), `hlo_sources` names each
fusion's origin instead: the innermost frames of the Python stack XLA keeps for every instruction.
"""

import collections
import dataclasses
import functools
import glob
import os
import pathlib
import re
import tempfile

import jax
from jax.profiler import ProfileData

REPOSITORY = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class KernelTime:
    name: str
    total_us: float
    count: int
    program_id: int | None = None  # the XLA executable that launched it (its HLO dump is module_<id>.*)
    source: str = ""  # where in the Python source, from the HLO dump ("" if not known)


@dataclasses.dataclass
class DeviceIdle:
    """How long the device waited between its first and last kernel: time when no stream ran a kernel or a copy."""

    span_us: float
    idle_us: float
    num_long_gaps: int  # gaps of at least LONG_GAP_US: the device waiting on the host (whom the profiler slows)
    long_gap_us: float
    # CUDA calls that launch work (kernels, graphs), by name, where the trace records the host's driver calls: how
    # many launches the host makes, e.g. whether XLA's command buffers (CUDA graphs) hold the kernels
    host_launches: dict[str, int] = dataclasses.field(default_factory=dict)


LONG_GAP_US = 10.0  # kernels inside a command buffer follow each other within a few microseconds


def device_kernel_times(fn, scopes: tuple[str, ...] = (), hlo_dump_dir: str | None = None
                        ) -> tuple[list[KernelTime], dict[str, float], float, DeviceIdle]:
    """kernel_times(profile of fn(), scopes) and device_idle; fn must block until its device work is done. With the
    directory XLA dumped the executables' HLO to, each kernel's `source` is filled in."""
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        try:
            fn()
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        data = ProfileData.from_file(paths[0])
        kernels, by_scope, busy_us = kernel_times(data, scopes)
        idle = dataclasses.replace(device_idle(data), host_launches=host_launch_calls(data))
    if hlo_dump_dir:
        sources = hlo_sources(read_hlo_dumps(hlo_dump_dir))
        for kernel in kernels:
            kernel.source = source_of(kernel, sources)
    return kernels, by_scope, busy_us, idle


def hlo_dump_flags(dump_dir: str) -> str:
    """XLA_FLAGS that dump every module's optimized HLO to dump_dir; set before JAX starts its backend."""
    return f"--xla_dump_to={dump_dir}"


def read_hlo_dumps(dump_dir: str) -> dict[int, str]:
    """{program id: optimized HLO text} of the modules XLA dumped to dump_dir."""
    texts = {}
    for path in glob.glob(os.path.join(dump_dir, "module_*after_optimizations.txt")):
        texts[int(os.path.basename(path).split(".")[0].removeprefix("module_"))] = pathlib.Path(path).read_text()
    return texts


def _table(text: str, title: str) -> dict[int, str]:
    """One of the numbered tables (FileNames, FunctionNames, FileLocations, StackFrames) heading an HLO text."""
    found = re.search(rf"^{title}\n(.*?)(?:\n\n|\Z)", text, re.M | re.S)
    rows = found.group(1).splitlines() if found else []
    return {int(row.split(" ", 1)[0]): row.split(" ", 1)[1] for row in rows}


def _profiler_spelling(name: str) -> str:
    """An HLO instruction's name as the profiler spells its kernel: "." and "-" become "_" (fusion.12 -> fusion_12)."""
    return re.sub(r"[.\-]", "_", name)


@functools.cache
def _in_project(path: str) -> bool:
    """A frame of this repository's engine code: not tools/, not an installed package under the repository."""
    resolved = pathlib.Path(path).resolve()
    return (resolved.is_relative_to(REPOSITORY) and not resolved.is_relative_to(REPOSITORY / "tools")
            and "site-packages" not in resolved.parts)


def hlo_sources(texts: dict[int, str], depth: int = 2) -> dict[tuple[int, str], str]:
    """{(program id, instruction name as the profiler spells it): "file.py:function < file.py:caller"} for every
    instruction of the optimized HLO texts whose Python stack passes through the engine's code (`_in_project`),
    innermost `depth` frames first."""
    sources = {}
    for program_id, text in texts.items():
        files = {key: value.strip('"') for key, value in _table(text, "FileNames").items()}
        functions = {key: value.strip('"') for key, value in _table(text, "FunctionNames").items()}
        locations = {}
        for key, value in _table(text, "FileLocations").items():
            fields = dict(re.findall(r"(\w+)=(\d+)", value))
            locations[key] = (files[int(fields["file_name_id"])], functions[int(fields["function_name_id"])])
        frames = {}  # frame -> (location, parent frame); XLA prints a parent as its id + 1, 1 for none
        for key, value in _table(text, "StackFrames").items():
            fields = dict(re.findall(r"(\w+)=(\d+)", value))
            frames[key] = (locations[int(fields["file_location_id"])], int(fields["parent_frame_id"]) - 1)
        where = {}
        for frame in frames:
            names, current, steps = [], frame, 0
            while current in frames and len(names) < depth and steps < len(frames):  # a cyclic table ends too
                (path, function), current = frames[current]
                steps += 1
                if _in_project(path):
                    names.append(f"{pathlib.Path(path).name}:{function}")
            where[frame] = " < ".join(names)
        for name, frame in re.findall(r"^\s*(?:ROOT )?%([\w.\-]+) = .*?stack_frame_id=(\d+)", text, re.M):
            if where.get(int(frame)):
                sources[(program_id, _profiler_spelling(name))] = where[int(frame)]
    return sources


def source_of(kernel: KernelTime, sources: dict[tuple[int, str], str]) -> str:
    """A kernel's source ("" if unknown): an XLA kernel is named after its HLO instruction."""
    return sources.get((kernel.program_id, _profiler_spelling(kernel.name)), "")


def _stream_lines(data: ProfileData) -> list:
    """The device lines that hold kernels, one per CUDA stream (other device lines regroup them by op)."""
    device_lines = [line for plane in data.planes if plane.name.startswith("/device:") for line in plane.lines]
    stream_lines = [line for line in device_lines if line.name.startswith("Stream")]
    if device_lines and not stream_lines:
        print("device_profile: no 'Stream' lines; device lines are", sorted({line.name for line in device_lines}))
    return stream_lines


def device_idle(data: ProfileData) -> DeviceIdle:
    """Idle time between the profile's first and last kernel, over all streams (a time any stream runs counts as
    busy), and the part of it spent in gaps of at least LONG_GAP_US."""
    intervals = sorted((event.start_ns, event.end_ns) for line in _stream_lines(data) for event in line.events)
    if not intervals:
        return DeviceIdle(0.0, 0.0, 0, 0.0)
    idle_ns, long_gaps, long_gap_ns = 0, 0, 0
    covered_until = intervals[0][1]
    for start, end in intervals[1:]:
        if start > covered_until:
            gap = start - covered_until
            idle_ns += gap
            if gap >= LONG_GAP_US * 1e3:
                long_gaps, long_gap_ns = long_gaps + 1, long_gap_ns + gap
        covered_until = max(covered_until, end)
    return DeviceIdle((covered_until - intervals[0][0]) / 1e3, idle_ns / 1e3, long_gaps, long_gap_ns / 1e3)


_LAUNCH_CALL = re.compile(r"^cu(da)?(Graph)?Launch")  # cuLaunchKernel(Ex), cuGraphLaunch, cudaLaunchKernel, ...


def host_launch_calls(data: ProfileData) -> dict[str, int]:
    """How many CUDA launch calls (kernels, graphs) the host planes of the trace record, by call name."""
    calls = collections.Counter(event.name for plane in data.planes if not plane.name.startswith("/device:")
                                for line in plane.lines for event in line.events if _LAUNCH_CALL.match(event.name))
    return dict(calls)


def kernel_times(data: ProfileData, scopes: tuple[str, ...] = ()) -> tuple[list[KernelTime], dict[str, float], float]:
    """(kernels sorted by total time, us per scope, device busy us) of a profile's device planes.

    A kernel counts towards the first of `scopes` (JAX named_call / named_scope names) found in its name or its op's
    name stack, else towards "other"."""
    totals, counts, by_scope = collections.defaultdict(float), collections.Counter(), collections.Counter()
    for line in _stream_lines(data):
        for event in line.events:
            stats = dict(event.stats)
            # told apart by executable too: the prefill's and the decode step's "fusion_12" are different code
            kernel = (event.name, int(stats["program_id"]) if "program_id" in stats else None)
            totals[kernel] += event.duration_ns / 1e3
            counts[kernel] += 1
            op_name = " ".join(str(stats[key]) for key in ("tf_op", "hlo_op", "name") if key in stats)
            scope = next((s for s in scopes if s in op_name or s in event.name), "other")
            by_scope[scope] += event.duration_ns / 1e3
    kernels = sorted((KernelTime(name, total, counts[(name, program)], program)
                      for (name, program), total in totals.items()), key=lambda k: -k.total_us)
    return kernels, dict(by_scope), sum(k.total_us for k in kernels)


def print_kernel_table(kernels: list[KernelTime], by_scope: dict[str, float], busy_us: float, idle: DeviceIdle | None,
                       top: int, per: int = 1, unit: str = "call") -> None:
    """Device idle time, scope totals and the top kernels with their share of device busy time, per `per` units
    (e.g. per forward); with sources known, the totals per source function (a kernel without a source counts under
    its own name)."""
    if idle is not None:
        print(f"device idle {idle.idle_us / per:.1f} us per {unit} of {idle.span_us / per:.1f} us from first to last "
              f"kernel; {idle.long_gap_us / per:.1f} us of it in {idle.num_long_gaps / per:.1f} gaps of "
              f">= {LONG_GAP_US:.0f} us per {unit} (the device waiting on the host, which the profiler slows: "
              f"compare the span with the unprofiled time)")
        if idle.host_launches:
            by_count = sorted(idle.host_launches.items(), key=lambda kv: -kv[1])
            print(f"host launch calls per {unit}: " + ", ".join(f"{name} {n / per:.1f}" for name, n in by_count))
    print(f"device busy {busy_us / per:.1f} us per {unit}; by scope: " + ", ".join(
        f"{scope} {us / per:.1f} us ({100 * us / busy_us:.0f}%)" for scope, us in sorted(by_scope.items(),
                                                                                          key=lambda kv: -kv[1])))
    print(f"top {top} kernels:")
    programs_of = collections.defaultdict(set)
    for kernel in kernels:
        programs_of[kernel.name].add(kernel.program_id)
    for kernel in kernels[:top]:
        # a name launched by several executables carries the executable's id
        name = kernel.name if len(programs_of[kernel.name]) == 1 else f"{kernel.name} @{kernel.program_id}"
        print(f"  {kernel.total_us / per:9.1f} us  {100 * kernel.total_us / busy_us:5.1f}%  "
              f"x{kernel.count / per:<6.1f} {name[:60]:<60} {kernel.source}")
    if any(kernel.source for kernel in kernels):
        by_function, launches = collections.Counter(), collections.Counter()
        for kernel in kernels:
            function = kernel.source.split(" < ")[0] if kernel.source else kernel.name
            by_function[function] += kernel.total_us
            launches[function] += kernel.count
        print(f"by source function (us per {unit}, kernels per {unit}):")
        for function, us in by_function.most_common():
            print(f"  {us / per:9.1f} us  {100 * us / busy_us:5.1f}%  x{launches[function] / per:<6.1f} {function}")
