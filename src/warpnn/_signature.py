"""What a Warp kernel's signature means to JAX: which arguments are arrays, scalars, outputs.

Warp's convention (shared by ``wp.jax_kernel``): the first ``len(args) - num_outputs``
parameters are inputs (arrays or scalars), the last ``num_outputs`` are output arrays.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from typing import Any

import numpy as np
import warp as wp

from . import _warp_compat as wc

_FLOAT_KINDS = ("f",)


@dataclasses.dataclass(frozen=True)
class ArgSpec:
    """One kernel parameter as JAX sees it.

    ``warp_ndim`` is the Warp array rank (what ``wp.tid()`` indexes); vector and matrix dtypes add
    ``inner_shape`` trailing JAX dims, so a ``wp.array(dtype=wp.vec3)`` is a JAX ``(n, 3)`` array.
    """

    name: str
    warp_type: Any
    is_array: bool
    warp_ndim: int
    inner_shape: tuple[int, ...]
    dtype: np.dtype  # the JAX/NumPy scalar dtype

    @property
    def jax_ndim(self) -> int:
        return self.warp_ndim + len(self.inner_shape)

    @property
    def is_float(self) -> bool:
        return self.dtype.kind in _FLOAT_KINDS

    @property
    def warp_dtype(self):
        """The Warp element type of an array argument (``wp.vec3``, ``wp.float32``, ...)."""
        return self.warp_type.dtype

    @property
    def warp_type_name(self) -> str:
        """How the argument reads in the kernel signature, e.g. ``wp.array(dtype=wp.vec3, ndim=1)``."""
        if not self.is_array:
            return f"wp.{self.warp_type.__name__}"
        return f"wp.array(dtype=wp.{self.warp_dtype.__name__}, ndim={self.warp_ndim})"

    def describe(self) -> str:
        if not self.is_array:
            return f"static {self.dtype.name} scalar"
        inner = f", inner dims {self.inner_shape}" if self.inner_shape else ""
        return f"{self.jax_ndim}-D {self.dtype.name} array ({self.warp_ndim} Warp dims{inner})"

    def jax_shape(self, warp_dims: tuple[int, ...]) -> tuple[int, ...]:
        return (*warp_dims, *self.inner_shape)


def _arg_spec(name: str, warp_type: Any, kernel_key: str) -> ArgSpec:
    if wc.matches_array_class(warp_type, wp.array):
        dtype = warp_type.dtype
        if hasattr(dtype, "_wp_scalar_type_"):  # vector / matrix / quaternion / transform
            inner, scalar = tuple(dtype._shape_), dtype._wp_scalar_type_
        elif dtype in wc.value_types:
            inner, scalar = (), dtype
        else:
            raise TypeError(
                f"Kernel '{kernel_key}', argument '{name}': arrays of {dtype} cannot cross into JAX. "
                "Use scalar, vector or matrix dtypes (wp.float32, wp.vec3, wp.mat33, ...)."
            )
        return ArgSpec(name, warp_type, True, warp_type.ndim, inner, np.dtype(wp.dtype_to_jax(scalar)))
    if warp_type in wc.value_types:
        return ArgSpec(name, warp_type, False, 0, (), np.dtype(wp.dtype_to_jax(warp_type)))
    raise TypeError(
        f"Kernel '{kernel_key}', argument '{name}' has type {warp_type}, which warpnn cannot pass from JAX. "
        "Supported: wp.array(...) of scalar/vector/matrix dtypes, and scalar types (float, int, wp.uint64 ids). "
        "Pass structs or vectors as arrays instead."
    )


@dataclasses.dataclass(frozen=True, eq=False)
class KernelSignature:
    """The parsed signature of one Warp kernel with a given number of outputs.

    Compared by identity: one instance exists per (kernel, num_outputs), see ``signature_of``, and one per
    set of constant inputs, see ``without_adjoints``.
    """

    kernel: Any
    inputs: tuple[ArgSpec, ...]
    outputs: tuple[ArgSpec, ...]
    # Float array inputs whose adjoint the adjoint call does not compute: inputs JAX does not differentiate
    # in this call (constants, stop_gradient). Set only on the variants ``without_adjoints`` returns.
    constant_inputs: frozenset[str] = frozenset()

    @property
    def key(self) -> str:
        return self.kernel.key

    @functools.cached_property
    def array_inputs(self) -> tuple[ArgSpec, ...]:
        return tuple(a for a in self.inputs if a.is_array)

    @functools.cached_property
    def adjoint_inputs(self) -> tuple[ArgSpec, ...]:
        """The inputs the adjoint call returns adjoints for: float arrays, less ``constant_inputs``."""
        return tuple(a for a in self.inputs if a.is_array and a.is_float and a.name not in self.constant_inputs)

    def without_adjoints(self, names: frozenset[str]) -> KernelSignature:
        """This signature with no adjoint computed for the inputs ``names`` (one instance per set of names).

        The launchers pass Warp a null adjoint array for them, and Warp's adjoint kernel skips the atomic
        adds into a null array, so an input that is not differentiated costs no memory traffic backward.
        Names of inputs that have no adjoint anyway (integer arrays, scalars) are ignored.
        """
        differentiable = {a.name for a in self.inputs if a.is_array and a.is_float}
        names = (frozenset(names) & differentiable) | self.constant_inputs
        if names == self.constant_inputs:
            return self
        base = self._base
        variant = base._variants.get(names)
        if variant is None:
            variant = base._variants[names] = dataclasses.replace(base, constant_inputs=names)
            variant.__dict__["_base"] = base
        return variant

    @functools.cached_property
    def _base(self) -> KernelSignature:
        return self

    @functools.cached_property
    def _variants(self) -> dict[frozenset[str], KernelSignature]:
        return {}

    @functools.cached_property
    def float_outputs(self) -> tuple[ArgSpec, ...]:
        return tuple(a for a in self.outputs if a.is_float)

    @property
    def has_adjoint(self) -> bool:
        """Whether Warp generates this kernel's adjoint (``enable_backward`` of the kernel, else its module).

        A kernel without one still runs forward (integer-only kernels such as neighbour searches often opt
        out to compile faster); only differentiating it is an error.
        """
        option = self.kernel.options.get("enable_backward")
        if option is None:
            option = self.kernel.module.options.get("enable_backward", True)
        return bool(option)

    @functools.cached_property
    def outputs_read(self) -> tuple[str, ...]:
        """Output arrays the kernel reads (not only writes), found conservatively in its source.

        Warp's adjoint replays the forward without its stores and atomics and accumulates the adjoint of
        every read into the array's adjoint, so a kernel that reads an output has no correct reverse
        mode through Warp (its replay sees the post-forward values, and the read's adjoint would be
        written into the cotangent). Kernels that only write outputs never touch the primal output
        arrays in the adjoint, so the forward's outputs need not be kept for the backward pass.
        """
        try:
            return tuple(n for n in self.output_names if _reads_any(self.kernel.adj.tree, {n}))
        except Exception:  # noqa: BLE001 - no source tree to inspect: assume every output is read
            return self.output_names

    @functools.cached_property
    def outputs_fully_written(self) -> tuple[str, ...]:
        """Outputs every thread stores exactly at its own ``wp.tid()`` index, unconditionally.

        When such an output's Warp shape equals the launch dims, each element is written by the
        launch, so it need not be zeroed first: for a bandwidth-bound elementwise kernel that memset
        would add a third of its memory traffic. Found conservatively in the kernel's source.
        """
        try:
            return tuple(n for n in self.output_names if n not in self.outputs_read and _fully_written(self.kernel.adj.tree, n))
        except Exception:  # noqa: BLE001 - no source tree: zero every output
            return ()

    @functools.cached_property
    def thread_private_arrays(self) -> tuple[frozenset[str], frozenset[str]]:
        """(private, assigned): array parameters a thread touches only at its own first ``wp.tid()``
        coordinate (``a[i]``, ``a[i, j]``, ``wp.atomic_add(a, i, v)``, ``a.shape``), and those the kernel stores
        into with ``a[...] = v`` (not only accumulates into).

        A CPU launch may be cut into slices of the first coordinate run by several threads (``_batched.py``):
        a private array is written only inside the slice that owns it, so no two threads touch one element; the
        other results of the slice are accumulated into per-thread partial buffers and summed, which is right
        only for arrays the kernel (or its adjoint) only accumulates into. Found conservatively in the source.
        """
        try:
            return _slice_access(self.kernel.adj.tree, [a.name for a in (*self.inputs, *self.outputs) if a.is_array])
        except Exception:  # noqa: BLE001 - no source tree: nothing is private, everything may be assigned
            return frozenset(), frozenset(a.name for a in (*self.inputs, *self.outputs) if a.is_array)

    @functools.cached_property
    def input_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.inputs)

    @functools.cached_property
    def output_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.outputs)


_WRITE_ONLY_CALLS = {"atomic_add", "atomic_sub"}  # their adjoints never read the array


def _reads_any(tree: ast.AST, names: set[str]) -> bool:
    """Conservatively, whether the kernel body reads any array in ``names``.

    Writes are ``a[i] = v``, ``a[i] += v`` / ``-=`` (atomic in Warp) and statement calls of
    ``wp.atomic_add(a, ...)`` / ``wp.atomic_sub``; any other mention of the name counts as a read.
    """
    write_only: set[int] = set()

    def mark(target):
        if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
            write_only.add(id(target.value))

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                mark(target)
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.Add, ast.Sub)):
            mark(node.target)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and node.value.args:
            func = node.value.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in _WRITE_ONLY_CALLS and isinstance(node.value.args[0], ast.Name):
                write_only.add(id(node.value.args[0]))
    return any(isinstance(n, ast.Name) and n.id in names and id(n) not in write_only for n in ast.walk(tree))


def _fully_written(tree: ast.AST, name: str) -> bool:
    """Whether the kernel's top level stores ``name[tid...]`` and never mentions ``name`` otherwise."""
    fn = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)), None)
    if fn is None or any(isinstance(n, ast.Return) for n in ast.walk(fn)):  # an early return skips stores
        return False
    tid_vars, stores = None, 0
    for stmt in fn.body:  # top level only: a store under `if` or in a loop may not run
        if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
            continue
        target, value = stmt.targets[0], stmt.value
        if isinstance(value, ast.Call) and getattr(value.func, "attr", getattr(value.func, "id", None)) == "tid":
            names = target.elts if isinstance(target, ast.Tuple) else [target]
            if all(isinstance(n, ast.Name) for n in names):
                tid_vars = [n.id for n in names]
        elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and target.value.id == name:
            index = target.slice.elts if isinstance(target.slice, ast.Tuple) else [target.slice]
            if tid_vars is None or [getattr(i, "id", None) for i in index] != tid_vars:
                return False
            stores += 1
    if tid_vars is None or stores == 0:
        return False
    assigned = []  # plain names bound anywhere (not names used inside subscript targets)
    for n in ast.walk(fn):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign, ast.For)) else []
        for t in targets:
            assigned += [e.id for e in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(e, ast.Name)]
    if any(assigned.count(v) != 1 for v in tid_vars):  # a reassigned tid variable no longer names this thread's element
        return False
    mentions = sum(isinstance(n, ast.Name) and n.id == name for n in ast.walk(fn))
    return mentions == stores


_ATOMIC_CALLS = {"atomic_add", "atomic_sub", "atomic_min", "atomic_max"}
_METADATA_ATTRS = {"shape", "ndim", "strides", "size"}


def _slice_access(tree: ast.AST, names: list[str]) -> tuple[frozenset[str], frozenset[str]]:
    """See ``KernelSignature.thread_private_arrays``."""
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    first = None
    for stmt in fn.body:  # the first coordinate: `i = wp.tid()` or `i, j = wp.tid()` at the top level
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call):
            func = stmt.value.func
            if getattr(func, "attr", getattr(func, "id", None)) == "tid" and len(stmt.targets) == 1:
                target = stmt.targets[0]
                lead = target.elts[0] if isinstance(target, ast.Tuple) and target.elts else target
                first = lead.id if isinstance(lead, ast.Name) else None
                break
    rebinds = 0
    for n in ast.walk(fn):  # a first coordinate bound more than once no longer names this thread's slice
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign, ast.For)) else []
        for t in targets:
            rebinds += sum(isinstance(e, ast.Name) and e.id == first for e in (t.elts if isinstance(t, ast.Tuple) else [t]))
    if rebinds != 1:
        first = None

    def own(index: ast.AST) -> bool:
        lead = index.elts[0] if isinstance(index, ast.Tuple) and index.elts else index
        return first is not None and isinstance(lead, ast.Name) and lead.id == first

    allowed: set[int] = set()  # ids of Name nodes used in a private way
    assigned: set[str] = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and own(n.slice):
            allowed.add(id(n.value))
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.attr in _METADATA_ATTRS:
            allowed.add(id(n.value))
        elif isinstance(n, ast.Call) and len(n.args) >= 2 and isinstance(n.args[0], ast.Name):
            if getattr(n.func, "attr", getattr(n.func, "id", None)) in _ATOMIC_CALLS and own(n.args[1]):
                allowed.add(id(n.args[0]))
        if isinstance(n, ast.Assign):
            for t in n.targets:
                for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(e, ast.Subscript) and isinstance(e.value, ast.Name):
                        assigned.add(e.value.id)
        elif isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Name):
            if getattr(n.func, "attr", getattr(n.func, "id", None)) in ("atomic_min", "atomic_max", "atomic_exch", "atomic_cas"):
                assigned.add(n.args[0].id)  # not a sum
    private = frozenset(
        name for name in names
        if all(id(n) in allowed for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == name)
    )
    return private, frozenset(assigned & set(names))


_SIGNATURES: dict[tuple[int, int], KernelSignature] = {}


def signature_of(kernel: Any, num_outputs: int) -> KernelSignature:
    """Parse (once) and return the signature of ``kernel`` with its last ``num_outputs`` args as outputs."""
    if not isinstance(kernel, wp.Kernel):
        raise TypeError(
            f"warpnn.jax_kernel expects a Warp kernel (a function decorated with @wp.kernel), "
            f"got {type(kernel).__name__}."
        )
    cache_key = (id(kernel), num_outputs)
    cached = _SIGNATURES.get(cache_key)
    if cached is not None and cached.kernel is kernel:
        return cached

    params = kernel.adj.args
    if not isinstance(num_outputs, int) or not 1 <= num_outputs <= len(params):
        raise ValueError(
            f"num_outputs={num_outputs!r} for kernel '{kernel.key}', whose parameters are "
            f"{[a.label for a in params]}. num_outputs counts the output arrays at the end of the "
            f"signature and must be between 1 and {len(params)}."
        )
    specs = [_arg_spec(a.label, a.type, kernel.key) for a in params]
    inputs, outputs = tuple(specs[: len(specs) - num_outputs]), tuple(specs[len(specs) - num_outputs :])
    for out in outputs:
        if not out.is_array:
            raise TypeError(
                f"Kernel '{kernel.key}': output argument '{out.name}' is a {out.dtype.name} scalar, but "
                f"outputs must be arrays. With num_outputs={num_outputs} the outputs are "
                f"{[o.name for o in outputs]}; lower num_outputs or make '{out.name}' a wp.array."
            )
    sig = KernelSignature(kernel, inputs, outputs)
    _SIGNATURES[cache_key] = sig
    return sig
