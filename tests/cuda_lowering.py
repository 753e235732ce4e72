"""Lowering for the GPU on a machine without one: what XLA would hand the H100's compiler, as text."""

import jax

H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)


def lowered_for_h100(jitted, *args) -> str:
    """StableHLO text of jitted(*args) (args may be ShapeDtypeStructs) lowered for CUDA on an abstract H100: Pallas
    kernels appear as Triton custom calls, and a lowering failure raises here."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=H100)):
        return jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
