"""Pallas kernels, each beside its pure-jnp reference and a dispatcher."""


def is_power_of_two(n: int) -> bool:
    """Triton tensors have power-of-two dimensions: the dispatchers fall back to the reference where they do not."""
    return n > 0 and n & (n - 1) == 0
