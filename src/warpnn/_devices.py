"""Which Warp device JAX computes on, and a check that Warp geometry objects live there."""

from __future__ import annotations

from typing import Any

import jax
import warp as wp


def jax_warp_device():
    """The Warp device of JAX's default device: ``cpu``, or the CUDA device of the first GPU."""
    if jax.default_backend() == "cpu":
        return wp.get_device("cpu")
    return wp.device_from_jax(jax.devices()[0])


def trace_devices() -> list:
    """The Warp devices of the backend JAX compiles for by default: where a trace's kernels must be loaded."""
    backend = jax.default_backend()
    if backend == "cpu":
        return [wp.get_device("cpu")]
    return [wp.device_from_jax(d) for d in jax.local_devices(backend=backend)]


def geometry_id(obj: Any, where: str) -> int:
    """The uint64 id of a Warp geometry object (``wp.Mesh``, ``wp.HashGrid``, ``wp.Bvh``, ``wp.Volume``), after
    checking that it lives on JAX's device: a kernel given the id of an object on another device reads
    invalid memory (on a GPU, an illegal address that poisons the CUDA context)."""
    wanted = jax_warp_device()
    device = getattr(obj, "device", None)
    if device is not None and wp.get_device(device) != wanted:
        raise ValueError(
            f"{where}: the {type(obj).__name__} lives on Warp device {device}, but JAX computes on {wanted}; a kernel "
            f"can only read geometry on its own device. Fix: build it there, e.g. with "
            f"device=warpnn.jax_warp_device() (for meshes: warpnn.kernels.mesh.make_mesh picks it)."
        )
    return int(obj.id)
