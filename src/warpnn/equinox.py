"""Warp kernels as Equinox modules: ``warpnn.equinox.WarpLayer``.

Params are array fields (found by ``eqx.is_inexact_array``), buffers are array fields whose gradient is
stopped (and which :func:`trainable` leaves out), static values are an ``eqx.field(static=True)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax

from ._binding import Binding, FrozenMapping

__all__ = ["WarpLayer", "trainable"]


class WarpLayer(eqx.Module):
    """A Warp kernel as an Equinox layer.

    For example:

    ```python
    binding = warpnn.bind(springs, inputs=["x"], launch_dims="edges", output_dims="x")
    layer = warpnn.equinox.WarpLayer(binding, params={"k": jnp.ones(1)}, buffers={"edges": edges},
                                     static={"scale": 1.0})
    f = layer(x)                                             # x: (n, 3) -> f: (n, 3)
    layer = dataclasses.replace(layer, static={"scale": 2.0})  # a new static value retraces
    ```

    Args:
        binding: from :func:`warpnn.bind`: the kernel, its call inputs and dims.
        params: ``{argument name: float array}``, trained (1-element arrays for trainable scalars).
        buffers: ``{argument name: array}``, not trained (connectivity, rest state).
        static: ``{argument name: Python number or Warp geometry object}`` for scalar arguments.
    """

    binding: Binding = eqx.field(static=True)
    params: dict[str, jax.Array]
    buffers: dict[str, jax.Array]
    static: FrozenMapping = eqx.field(static=True)

    def __init__(
        self,
        binding: Binding,
        params: Mapping[str, Any] | None = None,
        buffers: Mapping[str, Any] | None = None,
        static: Mapping[str, Any] | None = None,
    ):
        self.binding = binding
        self.params, self.buffers, self.static = binding.check_fields(params, buffers, static)

    def __call__(self, *inputs: jax.Array, key: jax.Array | None = None):
        """Launch the kernel on ``inputs`` (the binding's ``inputs``, in order); ``key`` is ignored, so the
        layer composes with ``eqx.nn.Sequential``. Returns the output array, or a tuple of them."""
        return self.binding(inputs, self.params, self.buffers, self.static)


def trainable(model) -> Any:
    """A filter spec for ``eqx.filter``/``eqx.partition``: every inexact array except WarpLayer buffers.

    ``eqx.filter(model, eqx.is_inexact_array)`` also works (buffers get zero gradients); this spec keeps
    buffers out of the optimizer state too, which matters for decoupled weight decay (``optax.adamw``).
    """

    def spec(node):
        if not isinstance(node, WarpLayer):
            return eqx.is_inexact_array(node)
        node = jax.tree.map(eqx.is_inexact_array, node)
        return eqx.tree_at(lambda layer: layer.buffers, node, jax.tree.map(lambda _: False, node.buffers))

    return jax.tree.map(spec, model, is_leaf=lambda node: isinstance(node, WarpLayer))
