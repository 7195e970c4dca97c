"""Warp kernels as Flax Linen modules: ``warpnn.linen.WarpLayer``.

Params live in the ``"params"`` collection (``self.param``), buffers in the ``"buffers"`` collection
(:data:`BUFFERS`; pass it to ``apply`` next to the params, the optimizer never sees it), static values are
dataclass attributes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from ._binding import Binding

__all__ = ["BUFFERS", "WarpLayer"]

BUFFERS = "buffers"
"""The variable collection that holds WarpLayer buffers: ``model.apply({"params": p, "buffers": b}, x)``."""


class WarpLayer(nn.Module):
    """A Warp kernel as a Linen layer.

    For example:

    ```python
    binding = warpnn.bind(springs, inputs=["x"], launch_dims="edges", output_dims="x")
    layer = warpnn.linen.WarpLayer(binding, params={"k": (nn.initializers.ones, (1,))},
                                   buffers={"edges": edges}, static={"scale": 1.0})
    variables = layer.init(key, x)             # {"params": {"k": ...}, "buffers": {"edges": ...}}
    f = layer.apply(variables, x)              # x: (n, 3) -> f: (n, 3)
    ```

    Attributes:
        binding: from :func:`warpnn.bind`: the kernel, its call inputs and dims.
        params: ``{argument name: initial float array, key -> array function, or (initializer, shape)}``;
            ``initializer(key, shape, dtype)`` gets the kernel argument's dtype.
        buffers: ``{argument name: array}``, the initial value of each buffer.
        static: ``{argument name: Python number or Warp geometry object}`` for scalar arguments.
    """

    binding: Binding
    params: Mapping[str, Any] | None = None
    buffers: Mapping[str, Any] | None = None
    static: Mapping[str, Any] | None = None

    def __post_init__(self):
        # Check at construction, before init/apply trace anything; params may still be initializers.
        self.binding.check_fields(self.params, self.buffers, self.static, params_are_initializers=True)
        super().__post_init__()

    @nn.compact
    def __call__(self, *inputs: jax.Array):
        """Launch the kernel on ``inputs`` (the binding's ``inputs``, in order). Returns the output array, or
        a tuple of them."""
        params = {n: self.param(n, self.binding.initializer(n, v)) for n, v in (self.params or {}).items()}
        buffers = {n: self.variable(BUFFERS, n, jnp.asarray, v).value for n, v in (self.buffers or {}).items()}
        return self.binding(inputs, params, buffers, self.static or {})
