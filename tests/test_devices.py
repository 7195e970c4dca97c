"""Geometry objects must live on the device JAX computes on: a foreign id would be read as garbage."""

import pytest

import warpnn
from warpnn import _devices

from .layer_kernels import unit_square_mesh


def test_jax_warp_device_is_where_jax_computes():
    import jax

    want = "cpu" if jax.default_backend() == "cpu" else "cuda"
    assert str(warpnn.jax_warp_device()).startswith(want)


def test_geometry_on_jax_device_gives_its_id():
    mesh = unit_square_mesh()
    assert _devices.geometry_id(mesh, "here") == int(mesh.id)


def test_geometry_on_another_device_is_refused(monkeypatch):
    mesh = unit_square_mesh()
    monkeypatch.setattr(_devices, "jax_warp_device", lambda: "cuda:7")  # pretend JAX computes elsewhere
    with pytest.raises(ValueError, match=r"static argument 'mesh': the Mesh lives on Warp device .* but JAX computes on cuda:7"):
        _devices.geometry_id(mesh, "static argument 'mesh'")
