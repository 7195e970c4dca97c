"""Warp kernels as Flax NNX modules: ``warpnn.nnx.WarpLayer``.

Each bound kernel argument becomes an attribute of the same name: params are ``nnx.Param``, buffers are
:class:`Buffer` variables (not ``nnx.Param``, so ``nnx.grad`` and ``nnx.Optimizer(..., wrt=nnx.Param)``
leave them alone), static values are plain Python attributes (part of the graph definition: assigning a
new one retraces ``nnx.jit``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from ._binding import Binding

__all__ = ["Buffer", "WarpLayer"]


class Buffer(nnx.Variable):
    """A non-trainable array of a :class:`WarpLayer` (connectivity, rest state), saved with the model state."""


class WarpLayer(nnx.Module):
    """A Warp kernel as an NNX layer.

    For example:

    ```python
    binding = warpnn.bind(springs, inputs=["x"], launch_dims="edges", output_dims="x")
    layer = warpnn.nnx.WarpLayer(binding, params={"k": jnp.ones(1)}, buffers={"edges": edges},
                                 static={"scale": 1.0})
    f = layer(x)            # x: (n, 3) -> f: (n, 3)
    layer.k[...]            # the nnx.Param
    layer.scale = 2.0       # a new static value; nnx.jit retraces
    ```

    Args:
        binding: from :func:`warpnn.bind`: the kernel, its call inputs and dims.
        params: ``{argument name: float array}``, stored as ``nnx.Param`` attributes of that name.
        buffers: ``{argument name: array}``, stored as :class:`Buffer` attributes.
        static: ``{argument name: Python number or Warp geometry object}``, stored as plain attributes.
    """

    def __init__(
        self,
        binding: Binding,
        params: Mapping[str, Any] | None = None,
        buffers: Mapping[str, Any] | None = None,
        static: Mapping[str, Any] | None = None,
    ):
        params, buffers, static = binding.check_fields(params, buffers, static)
        for name in binding.field_names:
            if hasattr(type(self), name):
                raise ValueError(
                    f"Kernel '{binding.signature.key}' argument '{name}' would hide nnx.Module.{name}; "
                    "rename the kernel argument."
                )
        self.binding = binding
        for name, value in params.items():
            setattr(self, name, nnx.Param(value))
        for name, value in buffers.items():
            setattr(self, name, Buffer(value))
        for name, value in static.items():
            setattr(self, name, value)

    def __call__(self, *inputs: jax.Array):
        """Launch the kernel on ``inputs`` (the binding's ``inputs``, in order). Returns the output array, or
        a tuple of them."""
        fields: dict[str, dict[str, Any]] = {"params": {}, "buffers": {}, "static": {}}
        for name in self.binding.field_names:
            value = getattr(self, name)
            if isinstance(value, (jax.Array, np.ndarray)) and not isinstance(value, jax.core.Tracer):
                raise TypeError(
                    f"{type(self).__name__}.{name} is a bare {np.shape(value)} array; NNX needs to know whether it "
                    f"is trained. Assign layer.{name} = nnx.Param(array) to train it, or "
                    f"layer.{name} = warpnn.nnx.Buffer(array) to keep it fixed."
                )
            role = "params" if isinstance(value, nnx.Param) else "buffers" if isinstance(value, nnx.Variable) else "static"
            fields[role][name] = value[...] if role != "static" else value
        return self.binding(inputs, fields["params"], fields["buffers"], fields["static"])
