"""Shared fixtures: tiny random checkpoints in the real HF formats, made once per test session."""

import pytest

from tools.make_checkpoint import make_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """checkpoints(arch, dtype="f32", **overrides) -> a tiny checkpoint directory, cached per arguments."""
    made = {}

    def get(arch: str, dtype: str = "f32", **overrides):
        key = (arch, dtype, tuple(sorted(overrides.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"{arch}_{dtype}")
            made[key] = make_checkpoint(out, arch, size="tiny", dtype=dtype, seed=len(made), **overrides)
        return made[key]

    return get
