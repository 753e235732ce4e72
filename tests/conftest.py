"""Shared fixtures: tiny random checkpoints in the real HF formats, made once per test session."""

import os
import zlib

import jax
import pytest
from safetensors.numpy import load_file, save_file

from tools.make_checkpoint import make_checkpoint

# The suite's time is mostly XLA compiling tiny programs, whose run time is negligible: LLVM's optimisation level 0
# cut a sample of the engine tests from 77 to 51 s on 2 CPU cores, and the interpret-mode kernel tests ran no slower.
# Set before the first computation starts a backend; the servers the tests spawn inherit it.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()


@pytest.fixture(autouse=True, scope="session")
def compilations_are_shared(tmp_path_factory):
    """One persistent XLA cache for the run, shared by the xdist workers: many tests build engines of the same
    shapes, whose start-up compiles the same bucketed programs (tests/engine alone: 98 -> 82 s on 2 CPU cores, cold).
    A cache hit still reports a compilation, so the engines' compile-after-warm-up guard sees it as before. The
    servers the tests spawn read the same settings from the environment."""
    run_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker's base lies in one directory per run
        run_dir = run_dir.parent
    settings = {"jax_compilation_cache_dir": str(run_dir / "xla-cache"),
                "jax_persistent_cache_min_compile_time_secs": 0.0}  # tiny models compile in well under a second
    previous = {name: getattr(jax.config, name) for name in settings}
    with pytest.MonkeyPatch.context() as environment:
        for name, value in settings.items():
            jax.config.update(name, value)
            environment.setenv(name.upper(), str(value))
        yield
    for name, value in previous.items():
        jax.config.update(name, value)


@pytest.fixture(autouse=True, scope="session")
def triton_modules_are_verified():
    """Each Pallas kernel a test lowers for the GPU passes Triton's MLIR verifier here, on the CPU: an invalid module
    (session 10: a loop bound typed i1) would otherwise fail only when the GPU machine compiles it."""
    try:  # private, and the one place that builds the module
        from jax._src.pallas.triton import lowering
        lower = lowering.lower_jaxpr_to_triton_module
    except (ImportError, AttributeError):  # another JAX moved it: the tests run unverified rather than not at all
        yield
        return

    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        result.module.operation.verify()  # raises MLIRError, naming the op, on an invalid module
        return result

    lowering.lower_jaxpr_to_triton_module = lower_and_verify
    yield
    lowering.lower_jaxpr_to_triton_module = lower


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """checkpoints(arch, dtype="f32", lm_head_scale=1, **overrides) -> a tiny checkpoint directory, cached.

    lm_head_scale > 1 makes the random model confident: its top token leads by a margin far above float noise, so
    greedy outputs do not hinge on near-ties (useful wherever two runs must agree token for token).
    """
    made = {}

    def get(arch: str, dtype: str = "f32", lm_head_scale: float = 1, **overrides):
        key = (arch, dtype, float(lm_head_scale), tuple(sorted(overrides.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"{arch}_{dtype}")
            # the seed depends on the checkpoint alone, not on which tests asked for checkpoints first
            seed = zlib.crc32(repr(key).encode())
            path = make_checkpoint(out, arch, size="tiny", dtype=dtype, seed=seed, num_shards=1, **overrides)
            if lm_head_scale != 1:
                weights = load_file(path / "model.safetensors")
                weights["lm_head.weight"] = weights["lm_head.weight"] * lm_head_scale
                save_file(weights, path / "model.safetensors")
            made[key] = path
        return made[key]

    return get
