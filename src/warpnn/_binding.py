"""Binding a Warp kernel's arguments to a module's fields: the framework-neutral core of the layers.

A :class:`Binding` says how a layer calls one kernel: which array arguments arrive as call arguments
(``inputs``) and how launch and output dims are found. The rest of the kernel's inputs are the layer's
own fields, split in three roles:

* ``params``: trainable float arrays (Equinox array fields, ``nnx.Param``, Linen ``self.param``);
* ``buffers``: arrays that are state but not trained (connectivity, rest state); the core stops their
  gradient, and each framework keeps them away from its optimizer;
* ``static``: the kernel's scalar arguments, compile-time constants of the call (Python numbers, or Warp
  geometry objects such as ``wp.Mesh`` whose ``.id`` feeds a ``wp.uint64`` argument).

``warpnn.equinox``, ``warpnn.nnx`` and ``warpnn.linen`` only decide where each role is stored; every check
and the call itself live here, so the three frameworks fail the same way and compute the same thing.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._bridge import WarpKernel, _check_array, _check_scalar, _normalize_dims, jax_kernel
from ._devices import geometry_id
from ._signature import ArgSpec

DimsRule = int | Sequence[int] | str | Callable[[Mapping[str, jax.Array]], Any] | None
"""Launch or output dims: ints, the name of an array argument whose (Warp) shape to use, or a function of
the dict ``{argument name: array}`` of every array argument of the call (inputs, params, buffers)."""

_STATIC_TRACER_MESSAGE = (
    "static value '{name}' of kernel '{key}' is {what}, but static values are compile-time constants of the "
    "layer (Python numbers, or Warp geometry objects for wp.uint64 ids); changing one retraces, it is never "
    "traced. Fix: pass a Python number, built outside jax.jit/grad/vmap. To train or trace it, declare it in the "
    "kernel as a 1-element array ({name}: wp.array(dtype=float)), read {name}[0], and bind it as a param: "
    "params={{'{name}': jnp.array([value])}}."
)


class FrozenMapping(Mapping):
    """An immutable, hashable ``{name: value}`` mapping: a layer's static kernel arguments, per-output dims.

    Hashable so that frameworks can keep it in their static (tree-structure) metadata: two layers with equal
    static values share a compiled function; changing a value retraces.
    """

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any] | None = None):
        self._items = tuple(sorted(dict(items or {}).items()))

    def __getitem__(self, name: str) -> Any:
        for key, value in self._items:
            if key == name:
                return value
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (key for key, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other) -> bool:
        return isinstance(other, FrozenMapping) and self._items == other._items

    def __repr__(self) -> str:
        return f"FrozenMapping({dict(self._items)!r})"


@dataclasses.dataclass(frozen=True)
class Binding:
    """How a layer calls a Warp kernel. Create with :func:`bind`; hashable, so frameworks keep it static."""

    kernel: Any  # the @wp.kernel
    num_outputs: int
    inputs: tuple[str, ...]
    launch_dims: DimsRule
    output_dims: DimsRule | FrozenMapping  # a FrozenMapping holds one rule per output name
    fn: WarpKernel = dataclasses.field(compare=False, repr=False)

    def __repr__(self) -> str:
        return (
            f"Binding({self.signature.key}: inputs {list(self.inputs)}, launch_dims={self.launch_dims!r}, "
            f"output_dims={self.output_dims!r})"
        )

    @property
    def signature(self):
        """The kernel's parsed signature (``.inputs``, ``.outputs``, ``.input_names``, ``.output_names``)."""
        return self.fn.signature

    @property
    def field_names(self) -> tuple[str, ...]:
        """Kernel input arguments that the layer must hold as params, buffers or static values."""
        return tuple(n for n in self.signature.input_names if n not in self.inputs)

    def spec(self, name: str) -> ArgSpec:
        return next(s for s in self.signature.inputs if s.name == name)

    # ----------------------------------------------------------------------------------------------
    # Checking a layer's fields: called by each adapter at construction, and again at every call.

    def check_fields(
        self,
        params: Mapping[str, Any] | None,
        buffers: Mapping[str, Any] | None,
        static: Mapping[str, Any] | None,
        *,
        params_are_initializers: bool = False,
    ) -> tuple[dict[str, Any], dict[str, jax.Array], FrozenMapping]:
        """Check that ``params``, ``buffers`` and ``static`` bind every non-input kernel argument exactly once.

        Args:
            params: ``{name: float array}`` of trainable arrays (or initializers, see below).
            buffers: ``{name: array}`` of non-trainable arrays.
            static: ``{name: Python number or Warp geometry object}`` for the kernel's scalar arguments.
            params_are_initializers: the params are Linen-style initial values, checked when created.

        Returns:
            ``(params, buffers, static)`` with arrays as JAX arrays and ``static`` as a hashable
            :class:`FrozenMapping`.

        Raises:
            ValueError/TypeError: naming the argument, what was expected, what arrived and the fix.
        """
        fields = {"params": dict(params or {}), "buffers": dict(buffers or {}), "static": dict(static or {})}
        self._check_names(fields)
        for role, values in fields.items():
            for name, value in values.items():
                if role == "static":
                    values[name] = self._check_static(name, value)
                elif not (role == "params" and params_are_initializers):
                    values[name] = jnp.asarray(_check_array(self.signature, self.spec(name), value))
        return fields["params"], fields["buffers"], FrozenMapping(fields["static"])

    def _check_names(self, fields: dict[str, dict[str, Any]]) -> None:
        sig, key = self.signature, self.signature.key
        seen: dict[str, str] = {name: "a call input" for name in self.inputs}
        for role, values in fields.items():
            for name in values:
                if not isinstance(name, str) or name not in sig.input_names:
                    where = "an output (outputs are returned, not bound)" if name in sig.output_names else "not an input"
                    raise ValueError(
                        f"{role}={{'{name}': ...}}: '{name}' is {where} of kernel '{key}'.\n{self.describe_arguments()}"
                    )
                if name in seen:
                    raise ValueError(
                        f"Kernel '{key}' argument '{name}' is bound twice: as {seen[name]} and in {role}=. "
                        f"Bind each argument once.\n{self.describe_arguments()}"
                    )
                seen[name] = f"{role}="
                self._check_role(name, role)
        unbound = [n for n in sig.input_names if n not in seen]
        if unbound:
            raise ValueError(
                f"Kernel '{key}' arguments {unbound} are not bound. Every input argument is a call input "
                "(warpnn.bind(..., inputs=[...])), a param (trainable array), a buffer (non-trainable array) or a "
                f"static value (scalar argument).\n{self.describe_arguments()}"
            )

    def _check_role(self, name: str, role: str) -> None:
        spec, key = self.spec(name), self.signature.key
        if role == "static" and spec.is_array:
            raise TypeError(
                f"Kernel '{key}' argument '{name}' is a {spec.describe()}, but static= holds the kernel's scalar "
                f"arguments. Bind '{name}' as a param (trainable), a buffer (not trained) or a call input."
            )
        if role != "static" and not spec.is_array:
            raise TypeError(
                f"Kernel '{key}' argument '{name}' is a {spec.describe()}: pass it in static={{'{name}': value}}, "
                f"not {role}=. To train it, declare it in the kernel as a 1-element array "
                f"({name}: wp.array(dtype=float)), read {name}[0], and bind it as a param."
            )
        if role == "params" and not spec.is_float:
            raise TypeError(
                f"Kernel '{key}' argument '{name}' is a {spec.describe()}; only float arrays can be trained. "
                f"Bind it as a buffer: buffers={{'{name}': ...}}."
            )

    def _check_static(self, name: str, value: Any) -> Any:
        if isinstance(value, (jax.Array, np.ndarray, jax.core.Tracer)):
            what = "a traced value" if isinstance(value, jax.core.Tracer) else f"an array of shape {np.shape(value)}"
            raise TypeError(_STATIC_TRACER_MESSAGE.format(name=name, key=self.signature.key, what=what))
        _check_scalar(self.signature, self.spec(name), _static_value(self.spec(name), value))
        return value

    def describe_arguments(self) -> str:
        """A listing of the kernel's arguments, for error messages."""
        sig = self.signature
        lines = [f"Kernel '{sig.key}' arguments:"]
        lines += [f"  {s.name}: {s.describe()}" + (" (call input)" if s.name in self.inputs else "") for s in sig.inputs]
        lines += [f"  {s.name}: {s.describe()} (output, returned)" for s in sig.outputs]
        return "\n".join(lines)

    # ----------------------------------------------------------------------------------------------
    # Initial values and the call.

    def initializer(self, name: str, value: Any) -> Callable[[jax.Array], jax.Array]:
        """A ``key -> array`` initializer for param ``name``, from an array, a ``key -> array`` function, or a
        ``(initializer, shape)`` pair with a JAX/Flax initializer ``init(key, shape, dtype)`` (dtype: the kernel's)."""
        dtype = self.spec(name).dtype
        if isinstance(value, tuple) and len(value) == 2 and callable(value[0]):
            init, shape = value
            return lambda key: init(key, tuple(shape), dtype)
        if callable(value) and not hasattr(value, "shape"):
            return value
        return lambda key: jnp.asarray(value)

    def __call__(
        self,
        args: Sequence[Any],
        params: Mapping[str, Any],
        buffers: Mapping[str, Any],
        static: Mapping[str, Any],
    ) -> jax.Array | tuple[jax.Array, ...]:
        """Launch the kernel with call inputs ``args`` and a layer's fields.

        Args:
            args: one array per name in ``inputs``, in that order.
            params, buffers, static: the layer's fields, as for :meth:`check_fields`.

        Returns:
            The kernel's output array, or a tuple of them when it has several outputs.
        """
        sig = self.signature
        if len(args) != len(self.inputs):
            raise TypeError(
                f"This layer of kernel '{sig.key}' takes {len(self.inputs)} call inputs {list(self.inputs)}, "
                f"got {len(args)}. The other arguments are the layer's params, buffers and static values."
            )
        self._check_names({"params": dict(params), "buffers": dict(buffers), "static": dict(static)})
        arrays = {**dict(zip(self.inputs, args)), **params}
        # Buffers are state, not trainable: no gradient reaches them whatever the caller differentiates.
        arrays.update({n: jax.lax.stop_gradient(v) for n, v in buffers.items()})
        for name, value in static.items():
            self._check_static(name, value)
        values = {**arrays, **{n: _static_value(self.spec(n), v) for n, v in static.items()}}
        launch = self._dims(self.launch_dims, arrays, "launch_dims")
        if isinstance(self.output_dims, FrozenMapping):
            out = {n: self._dims(rule, arrays, f"output_dims['{n}']") for n, rule in self.output_dims.items()}
        else:
            out = self._dims(self.output_dims, arrays, "output_dims")
        outputs = self.fn(*(values[n] for n in sig.input_names), launch_dims=launch, output_dims=out)
        return outputs[0] if len(outputs) == 1 else outputs

    def _dims(self, rule: DimsRule, arrays: Mapping[str, Any], what: str):
        if isinstance(rule, str):
            return tuple(np.shape(arrays[rule])[: self.spec(rule).warp_ndim])
        if callable(rule):
            dims = rule(arrays)
            try:
                if isinstance(dims, str):
                    raise TypeError
                return _normalize_dims(dims, what, self.signature)
            except (TypeError, ValueError):
                raise TypeError(
                    f"Kernel '{self.signature.key}': the {what} function {rule!r} must return 1 to 4 non-negative "
                    f"ints (an int or a tuple), got {dims!r}. It receives {{name: array}} of the call's array "
                    f"arguments {list(arrays)}."
                ) from None
        return rule


def _static_value(spec: ArgSpec, value: Any) -> Any:
    # A Warp geometry object (wp.Mesh, wp.HashGrid, wp.Bvh, wp.Volume) stands for its uint64 id; the layer
    # keeps the object itself, so the object outlives every call that uses the id.
    if spec.dtype == np.uint64 and not isinstance(value, (numbers.Number, np.generic)) and hasattr(value, "id"):
        return geometry_id(value, f"static argument '{spec.name}'")
    return value


def bind(
    kernel,
    *,
    inputs: Sequence[str] = (),
    num_outputs: int = 1,
    launch_dims: DimsRule = None,
    output_dims: DimsRule | Mapping[str, DimsRule] = None,
) -> Binding:
    """Describe how a layer calls a Warp kernel; pass the result to a framework's ``WarpLayer``.

    One binding serves ``warpnn.equinox.WarpLayer``, ``warpnn.nnx.WarpLayer`` and ``warpnn.linen.WarpLayer``
    alike; the layer then binds the kernel's remaining input arguments, by name, to its params, buffers and
    static values.

    For example:

    ```python
    @wp.kernel
    def springs(x: wp.array(dtype=wp.vec3), edges: wp.array(dtype=wp.vec2i), k: wp.array(dtype=float),
                scale: float, f: wp.array(dtype=wp.vec3)):
        ...

    binding = warpnn.bind(springs, inputs=["x"], launch_dims="edges", output_dims="x")
    layer = warpnn.equinox.WarpLayer(binding, params={"k": jnp.ones(1)}, buffers={"edges": edges},
                                     static={"scale": 1.0})
    f = layer(x)   # (n, 3)
    ```

    Args:
        kernel: a ``@wp.kernel``; its first arguments are inputs, its last ``num_outputs`` are outputs.
        inputs: names of the array arguments passed when the layer is called, in call order.
        num_outputs: how many trailing kernel arguments are outputs. The layer returns one array, or a
            tuple when there are several.
        launch_dims: the kernel's launch dims: ints; the name of an array argument whose Warp shape to use
            (``"edges"`` launches one thread per edge); or a function of ``{name: array}`` of every array
            argument returning ints. Default: the Warp shape of the kernel's first array argument.
        output_dims: each output's dims, in the same forms, or a dict ``{output name: dims}``. Default:
            the launch dims.

    Returns:
        A hashable :class:`Binding`.

    Raises:
        ValueError/TypeError: when a name is not an array input of the kernel, or dims are malformed.
    """
    fn = jax_kernel(kernel, num_outputs)
    sig = fn.signature
    inputs = (inputs,) if isinstance(inputs, str) else tuple(inputs)
    array_names = [s.name for s in sig.inputs if s.is_array]
    for name in inputs:
        if name not in array_names:
            kind = "not an input argument"
            if name in sig.input_names:
                kind = "a scalar argument (scalars are static: pass them to the layer's static=)"
            raise ValueError(
                f"warpnn.bind(inputs=...): '{name}' is {kind} of kernel '{sig.key}'; call inputs are arrays among "
                f"{array_names}."
            )
    if len(set(inputs)) != len(inputs):
        raise ValueError(f"warpnn.bind(inputs={list(inputs)}): a name appears twice.")

    def check_rule(rule, what):
        if rule is None or callable(rule):
            return rule
        if isinstance(rule, str):
            if rule not in array_names:
                raise ValueError(
                    f"warpnn.bind({what}='{rule}'): a dims name must be an array input of kernel '{sig.key}', one "
                    f"of {array_names}."
                )
            return rule
        return _normalize_dims(rule, what, sig)

    if isinstance(output_dims, Mapping):
        if set(output_dims) != set(sig.output_names):
            raise ValueError(
                f"warpnn.bind(output_dims={{...}}): the keys must be exactly the outputs {list(sig.output_names)} "
                f"of kernel '{sig.key}', got {list(output_dims)}."
            )
        output_dims = FrozenMapping({n: check_rule(output_dims[n], f"output_dims['{n}']") for n in sig.output_names})
    else:
        output_dims = check_rule(output_dims, "output_dims")
    return Binding(kernel, num_outputs, inputs, check_rule(launch_dims, "launch_dims"), output_dims, fn)
