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


# --------------------------------------------------------------------------------------------------
# Per-array access of a whole kernel, for callers that replay launches of arbitrary kernels (the launch
# tracer): which array parameters a kernel reads, which it writes, and how.

# Builtins whose first argument is written; only these two, used as statements, merely accumulate.
_ATOMIC_WRITE_CALLS = {
    "atomic_add", "atomic_sub", "atomic_min", "atomic_max", "atomic_cas", "atomic_exch",
    "atomic_and", "atomic_or", "atomic_xor", "tile_atomic_add",
}
_PLAIN_WRITE_CALLS = {"tile_store", "array_store"}  # first argument written, old values not read
_READ_ONLY_CALLS = {"tile_load", "lower_bound", "len"}  # array arguments only read


@dataclasses.dataclass(frozen=True)
class ArrayAccess:
    """How one kernel uses one of its array parameters, found conservatively in its source.

    ``accumulated_only``: written only by ``a[i] += v`` / ``-=`` or statement calls of ``wp.atomic_add`` /
    ``wp.atomic_sub``, and never read, so the launch's effect is "previous value + what the kernel adds".
    Any use the analysis cannot classify (an array passed to a ``@wp.func``, bound to a local name, ...)
    counts as both a read and a plain write.
    """

    read: bool
    written: bool
    accumulated_only: bool

    @property
    def read_and_written(self) -> bool:
        return self.read and self.written


def array_accesses(kernel: Any) -> dict[str, ArrayAccess]:
    """How ``kernel`` reads and writes each of its array parameters, keyed by parameter name.

    Calls of user ``@wp.func``s are followed into their source (arrays passed positionally or by keyword);
    anything else the analysis cannot classify counts as a read and a plain write. Raises ``TypeError``
    when the kernel has no source tree to inspect (nothing can then be assumed).
    """
    cached = getattr(kernel, "_warpnn_array_accesses", None)
    if cached is not None:
        return cached
    adj = getattr(kernel, "adj", None)
    if getattr(adj, "tree", None) is None:
        raise TypeError(f"Kernel '{getattr(kernel, 'key', kernel)}' has no Python source to analyse.")
    reads, accumulates, plain_writes = _function_accesses(adj, depth=0)
    accesses = {
        n: ArrayAccess(
            read=n in reads,
            written=n in accumulates or n in plain_writes,
            accumulated_only=n in accumulates and n not in plain_writes and n not in reads,
        )
        for n in sorted(a.label for a in adj.args if wc.matches_array_class(a.type, wp.array))
    }
    kernel._warpnn_array_accesses = accesses
    return accesses


_MAX_CALL_DEPTH = 8


def _user_function(adj, func_node):
    """The user ``@wp.func`` a call refers to, if it is one whose source can be followed."""
    scope = getattr(adj.func, "__globals__", {})
    if isinstance(func_node, ast.Name):
        target = scope.get(func_node.id)
    elif isinstance(func_node, ast.Attribute) and isinstance(func_node.value, ast.Name):
        target = getattr(scope.get(func_node.value.id), func_node.attr, None)
    else:
        return None
    if isinstance(target, wp._src.context.Function) and not target.is_builtin() and getattr(target, "adj", None) is not None:
        return target
    return None


def _function_accesses(adj, depth: int) -> tuple[set[str], set[str], set[str]]:
    """(read, accumulated, plainly written) array parameters of one kernel or ``@wp.func`` body."""
    tree = adj.tree
    names = {a.label for a in adj.args if wc.matches_array_class(a.type, wp.array)}
    reads, accumulates, plain_writes, classified = set(), set(), set(), set()
    statements = {id(p.value) for p in ast.walk(tree) if isinstance(p, ast.Expr)}

    def array_name(node):
        return node.id if isinstance(node, ast.Name) and node.id in names else None

    def subscript_base(node):
        return array_name(node.value) if isinstance(node, ast.Subscript) else None

    def unknown(name):
        reads.add(name)
        plain_writes.add(name)

    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                name = subscript_base(target)
                if name is None:
                    continue
                classified.add(id(target.value))
                if isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.Add, ast.Sub)):
                    accumulates.add(name)  # Warp makes `a[i] += v` an atomic add
                elif isinstance(node, ast.AugAssign):
                    unknown(name)
                else:
                    plain_writes.add(name)
        elif isinstance(node, ast.Call):
            fname = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            passed = [(i, None, a) for i, a in enumerate(node.args)] + [(None, k.arg, k.value) for k in node.keywords]
            passed = [(i, kw, array_name(a), a) for i, kw, a in passed if array_name(a)]
            if not passed:
                continue
            callee = _user_function(adj, node.func) if depth < _MAX_CALL_DEPTH else None
            callee_access = _function_accesses(callee.adj, depth + 1) if callee is not None else None
            for i, kw, name, arg in passed:
                classified.add(id(arg))
                if callee_access is not None:
                    params = [a.label for a in callee.adj.args]
                    param = kw if kw is not None else params[i] if i < len(params) else None
                    if param is None:
                        unknown(name)
                        continue
                    for found, into in zip(callee_access, (reads, accumulates, plain_writes)):
                        if param in found:
                            into.add(name)
                elif i == 0 and fname in _ATOMIC_WRITE_CALLS:
                    if fname in ("atomic_add", "atomic_sub", "tile_atomic_add") and id(node) in statements:
                        accumulates.add(name)
                    else:  # min/max/cas/exch, or a used return value: the old value is read
                        unknown(name)
                elif i == 0 and fname in _PLAIN_WRITE_CALLS:
                    plain_writes.add(name)
                elif fname in _READ_ONLY_CALLS:
                    reads.add(name)
                else:  # another builtin or a function whose source cannot be followed
                    unknown(name)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            name = subscript_base(node)
            if name is not None:
                classified.add(id(node.value))
                reads.add(name)
        elif isinstance(node, ast.Attribute) and array_name(node.value) and node.attr in ("shape", "ndim", "size"):
            classified.add(id(node.value))  # metadata, not data
        elif isinstance(node, (ast.If, ast.IfExp, ast.While, ast.UnaryOp, ast.BoolOp)):
            # `if arr:` / `not arr` / `a and b` test for a null array: metadata, not data
            tests = node.values if isinstance(node, ast.BoolOp) else [node.operand if isinstance(node, ast.UnaryOp) else node.test]
            if isinstance(node, ast.UnaryOp) and not isinstance(node.op, ast.Not):
                tests = []
            classified.update(id(t) for t in tests if array_name(t))
    for node in ast.walk(tree):  # any other mention (aliasing, returning the array, ...): unknown
        name = array_name(node)
        if name is not None and id(node) not in classified:
            unknown(name)
    return reads, accumulates, plain_writes


def fully_written(kernel: Any, name: str) -> bool:
    """Whether every thread of ``kernel`` stores ``name[tid...]`` unconditionally (see ``outputs_fully_written``)."""
    try:
        return _fully_written(kernel.adj.tree, name)
    except Exception:  # noqa: BLE001 - no source tree: not provably written
        return False
