"""What a Warp kernel's signature means to JAX: which arguments are arrays, scalars, outputs.

Warp's convention (shared by ``wp.jax_kernel``): the first ``len(args) - num_outputs``
parameters are inputs (arrays or scalars), the last ``num_outputs`` are output arrays.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
import numpy as np
import warp as wp

from . import _warp_compat as wc
from ._access import (ArrayUse, _fully_written, analyse_array_uses, codegen_access, codegen_facts,
                      values_only_refill_integer_arrays, warp_builds_adjoint)
from ._twins import with_adjoint
from warp._src.codegen import Struct



@dataclasses.dataclass(frozen=True)
class ArgSpec:
    """One kernel parameter as JAX sees it.

    ``warp_ndim`` is the Warp array rank (what ``wp.tid()`` indexes); vector and matrix dtypes add
    ``inner_shape`` trailing JAX dims, so a ``wp.array(dtype=wp.vec3)`` is a JAX ``(n, 3)`` array.
    """

    name: str  # a struct's fields are named "param.field" (nested: "param.field.sub")
    warp_type: Any
    is_array: bool
    warp_ndim: int
    inner_shape: tuple[int, ...]
    dtype: np.dtype | None  # the JAX/NumPy scalar dtype (None for a struct)
    fields: tuple[ArgSpec, ...] = ()  # a struct's fields, in declaration order

    @property
    def is_struct(self) -> bool:
        return isinstance(self.warp_type, Struct)

    @property
    def leaves(self) -> tuple[ArgSpec, ...]:
        """The arrays and scalars this parameter consists of: itself, or a struct's fields, flattened."""
        if not self.is_struct:
            return (self,)
        return tuple(leaf for f in self.fields for leaf in f.leaves)

    @property
    def field_path(self) -> tuple[str, ...]:
        """The attribute path of a struct field inside its parameter (``()`` for a parameter)."""
        return tuple(self.name.split(".")[1:])

    @property
    def jax_ndim(self) -> int:
        return self.warp_ndim + len(self.inner_shape)

    @property
    def is_float(self) -> bool:
        # np.issubdtype, not dtype.kind: ml_dtypes' bfloat16 has kind 'V'
        return self.dtype is not None and bool(jnp.issubdtype(self.dtype, jnp.floating))

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
        if self.is_struct:
            return f"wp.struct {self.warp_type.key} (a dict of its fields {[f.name.split('.')[-1] for f in self.fields]})"
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
    if isinstance(warp_type, Struct):
        fields = tuple(_arg_spec(f"{name}.{field}", var.type, kernel_key) for field, var in warp_type.vars.items())
        return ArgSpec(name, warp_type, False, 0, (), None, fields)
    raise TypeError(
        f"Kernel '{kernel_key}', argument '{name}' has type {warp_type}, which warpnn cannot pass from JAX. "
        "Supported: wp.array(...) of scalar/vector/matrix dtypes, scalar types (float, int, wp.uint64 ids), and "
        "wp.struct's of those. Pass vectors or matrices as arrays (a wp.array(dtype=wp.vec3) of length 1) instead."
    )


@dataclasses.dataclass(frozen=True, eq=False)
class KernelSignature:
    """The parsed signature of one Warp kernel with a given number of outputs and in-out arrays.

    ``inputs`` are the parameters the caller passes (in-out arrays among them, in signature order), ``outputs``
    the pure outputs at the end of the signature. A call returns the in-out arrays' new values first, then the
    outputs (Warp's order). Compared by identity: one instance exists per (kernel, num_outputs, in-out names,
    block_dim), see ``signature_of``, and one per set of constant and ``None`` inputs, see ``variant``.
    """

    kernel: Any
    inputs: tuple[ArgSpec, ...]
    outputs: tuple[ArgSpec, ...]
    in_out_names: tuple[str, ...] = ()
    block_dim: int | None = None  # threads per block (None: Warp's FFI default, 256 on CUDA and 1 on the CPU)
    # Float array inputs whose adjoint the adjoint call does not compute: inputs JAX does not differentiate
    # in this call (constants, stop_gradient). Set only on the variants ``variant`` returns.
    constant_inputs: frozenset[str] = frozenset()
    # Array inputs passed as None: Warp gets a null array (no operand, no adjoint).
    null_inputs: frozenset[str] = frozenset()
    # (input, output) pairs whose input adjoint the adjoint call computes in the output's cotangent buffer
    # (see ``in_place_pairs_for``). Set only on the variants ``variant`` returns.
    adjoints_in_place: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> str:
        return self.kernel.key

    # -- the analysis of what the kernel reads and writes

    @functools.cached_property
    def uses(self) -> dict[str, ArrayUse]:
        """How the kernel uses each array parameter (``ArrayUse``), from its source; shared by all variants."""
        if self._base is not self:
            return self._base.uses
        return analyse_array_uses(self.kernel, (*self.inputs, *self.outputs))

    @functools.cached_property
    def input_leaves(self) -> tuple[ArgSpec, ...]:
        """Inputs with every struct flattened into its fields: what the caller's values become."""
        return tuple(leaf for a in self.inputs for leaf in a.leaves)

    @functools.cached_property
    def kernel_has_return(self) -> bool:
        """Whether the kernel body has a ``return`` (which may guard the accesses after it)."""
        try:
            return any(isinstance(n, ast.Return) for n in ast.walk(self.kernel.adj.tree))
        except Exception:  # noqa: BLE001 - no source tree: assume the accesses may be guarded
            return True

    @functools.cached_property
    def written_inputs(self) -> tuple[str, ...]:
        """Array inputs (not in-out) that the kernel may write: an error at construction (XLA owns them)."""
        return tuple(s.name for s in self.input_leaves if s.is_array and s.name not in self.in_out_names
                     and self.uses[s.name].writes)

    @functools.cached_property
    def reverse_problems(self) -> dict[str, str]:
        """Arrays that Warp's adjoint cannot differentiate, with the reason: in-out arrays and outputs read and
        written in place (``ArrayUse.in_place_problem``), and float arrays with an adjoint whose shape or pointer
        Warp's adjoint resets before it is done with them (``ArrayUse.adjoint_reset``: negative indices then write
        before the buffer, or additions are lost)."""
        integers = frozenset(s.name for s in (*self.in_out, *self.outputs) if s.is_array and not s.is_float)
        problems = {s.name: problem for s in (*self.in_out, *self.outputs)
                    if (problem := self.uses[s.name].in_place_problem()) is not None
                    and not (s.name in integers and self.uses[s.name].undecided is None
                             and not any(a.kind == "read-write" or a.via for a in self.uses[s.name].accesses)
                             and values_only_refill_integer_arrays(self.kernel.adj.tree, s.name, integers))}
        for s in (*self.adjoint_inputs, *self.float_results):
            where = self.uses[s.name].adjoint_reset
            if where is not None and s.name not in problems:
                problems[s.name] = (
                    f"{where} measures it after it was used, and Warp's adjoint of that measurement resets the "
                    "shape (or pointer) of its adjoint, so the adjoints of the accesses before it would index the "
                    "adjoint wrongly (memory corruption with a negative index). Measure it in the kernel body and "
                    "pass the size to the function as an argument")
        return problems

    @functools.cached_property
    def adjoint_problems(self) -> tuple[str, ...]:
        """Where Warp's adjoint of the kernel (or of a ``@wp.func`` it calls) would be silently wrong, one reason
        each (``_access.CodegenFacts``): dynamic loops whose adjoint depends on a carried value or that leave an
        iteration early, while loops with anything differentiable in them, calls Warp has no adjoint for, and
        ``wp.grad`` calls (forward-only in Warp)."""
        return codegen_facts(self.kernel).adjoint_problems

    def reverse_refusal_reasons(self) -> list[str]:
        """Why reverse mode must refuse this kernel, one phrase per array, loop or call (empty: it may
        differentiate). A kernel compiled without an adjoint differentiates through its twin built with one
        (``_twins.with_adjoint``), unless Warp cannot generate that twin."""
        reasons = [*(f"array '{n}': {why}" for n, why in self.reverse_problems.items()), *self.adjoint_problems]
        if not self.has_adjoint and codegen_access(with_adjoint(self.kernel)) is None:
            reasons.append("it was compiled without an adjoint (enable_backward=False on the kernel or its module), "
                           "and Warp's code generator fails on it built with one")
        return reasons

    @functools.cached_property
    def replay_buffers(self) -> tuple[ArgSpec, ...]:
        """Results written inside a ``@wp.func``: Warp's adjoint kernel runs each ``@wp.func`` call's forward again
        before its adjoint, stores and atomics included, into the buffer it gets as the array's value.

        The adjoint call gives each a buffer of its own: a result after ``carried_adjoints``, aliased to the
        primal operand (so XLA copies the operand where anything else still reads it) and discarded afterwards.
        Without it the replay wrote into XLA's buffers (a pure output's slot held its cotangent: a wrong gradient
        and a changed cotangent array; an in-out array's slot holds its value before the launch).
        """
        return tuple(s for s in self.results if self.uses[s.name].written_in_function is not None)

    @functools.cached_property
    def outputs_read(self) -> tuple[str, ...]:
        """Pure outputs the kernel reads (it reads zeros it did not write, or values it wrote itself)."""
        return tuple(s.name for s in self.outputs if self.uses[s.name].reads)

    @functools.cached_property
    def outputs_fully_written(self) -> tuple[str, ...]:
        """Outputs every thread stores exactly at its own ``wp.tid()`` index on every path (see ``_fully_written``).

        When such an output's Warp shape equals the launch dims, each element is written by the
        launch, so it need not be zeroed first: for a bandwidth-bound elementwise kernel that memset
        would add a third of its memory traffic. Found conservatively in the kernel's source.
        """
        try:
            return tuple(n for n in self.output_names if n not in self.outputs_read and _fully_written(self.kernel.adj.tree, n))
        except Exception:  # noqa: BLE001 - no source tree: zero every output
            return ()

    # -- the buffers of the forward and adjoint calls

    @functools.cached_property
    def array_inputs(self) -> tuple[ArgSpec, ...]:
        """The forward call's operands: array inputs (in-out ones included), less those passed as None."""
        return tuple(a for a in self.input_leaves if a.is_array and a.name not in self.null_inputs)

    @functools.cached_property
    def replay_on_outputs(self) -> tuple[str, ...]:
        """In-out arrays whose adjoint replays on their values after the launch: a launch-time proof found that
        each thread reads an element it writes only after its one write (``ArrayUse.replay_outputs``), or the kernel
        never reads them (``unread_in_out``)."""
        return tuple(s.name for s in self.in_out if self.uses[s.name].replay_outputs or s.name in self.unread_in_out)

    @functools.cached_property
    def unread_in_out(self) -> tuple[str, ...]:
        """In-out arrays the kernel never reads: no load, tile load or atomic other than an add or a subtract in its
        source or the ``@wp.func`` s it calls, by warpnn's walk and Warp's code generator (``ArrayUse.reads``), and
        no view.

        The adjoint reads none of their values either (Warp's adjoint of a store or an atomic add reads the element's
        adjoint, its replay recomputes loads only and skips atomics), so the backward pass keeps none of them: zeros
        stand in for a float one (``_bridge``), the values after the launch for an integer one. Kept before the
        launch, they cost a copy per launch (the launch writes them in place); kept after it, a slot in a scan's stack
        of residuals per step: the humanoid's 117 MB constraint Jacobian, written in place by three kernels a step at
        8,192 worlds."""
        return tuple(s.name for s in self.in_out
                     if not (self.uses[s.name].reads or self.uses[s.name].viewed or self.uses[s.name].adjoint_reset))

    @functools.cached_property
    def in_out(self) -> tuple[ArgSpec, ...]:
        return tuple(a for a in self.input_leaves if a.name in self.in_out_names)

    @functools.cached_property
    def results(self) -> tuple[ArgSpec, ...]:
        """The forward call's results: the in-out arrays' new values, then the outputs."""
        return (*self.in_out, *self.outputs)

    @functools.cached_property
    def float_results(self) -> tuple[ArgSpec, ...]:
        """Results with a cotangent, in result order: the adjoint call's cotangent operands."""
        return tuple(a for a in self.results if a.is_float)

    @functools.cached_property
    def float_outputs(self) -> tuple[ArgSpec, ...]:
        return tuple(a for a in self.outputs if a.is_float)

    @functools.cached_property
    def adjoint_inputs(self) -> tuple[ArgSpec, ...]:
        """The inputs the adjoint call returns zero-initialised adjoints for: float arrays that are not in-out,
        less ``constant_inputs`` and ``null_inputs``."""
        in_place = {x for x, _ in self.adjoints_in_place}
        return tuple(a for a in self.array_inputs if a.is_float and a.name not in self.constant_inputs
                     and a.name not in self.in_out_names and a.name not in in_place)

    @functools.cached_property
    def carried_adjoints(self) -> tuple[ArgSpec, ...]:
        """Results whose adjoint buffer the adjoint launch updates in place, as ``wp.Tape`` does.

        The adjoint call returns them after ``adjoint_inputs``, each starting as its cotangent (the call aliases
        the cotangent operand to it) and seen by Warp as the primal array's ``grad``, so that Warp's adjoint of a
        store zeroes the element it overwrote and the adjoint of a read adds to it: for an in-out array the
        result is the adjoint of its value before the launch. Float in-out arrays, and float outputs the kernel
        reads, may store to twice or writes through a view (``orow = out[i]``, ``wp.atomic_add(out[w], j, v)``,
        ``wp.tile_store(out[i], t)``: Warp's adjoint of a view finds the adjoint in the viewed array's ``grad``, and
        zeroes what a store overwrote there, so that must be a buffer the call owns); and the outputs of
        ``adjoints_in_place``, whose carried adjoint ends as their input's adjoint.
        """
        in_place = {y for _, y in self.adjoints_in_place}
        return tuple(a for a in self.float_results if a.name in self.in_out_names or a.name in in_place
                     or self.uses[a.name].reads or self.uses[a.name].may_store_twice or self.uses[a.name].viewed)

    @functools.cached_property
    def in_place_pairs(self) -> tuple[tuple[str, str], ...]:
        """(input, output) pairs of an elementwise update ``y[i] = f(x[i])`` that may share one buffer.

        Forward (a call that is not differentiated, ``_bridge._with_outputs_in_place``): ``y`` is written into
        ``x``'s buffer, as an in-out array is, so a ``lax.scan`` carrying ``x`` needs no copy of ``y`` into its
        carry. Backward (``adjoints_in_place``): ``x``'s adjoint is computed in ``y``'s cotangent buffer, as an
        in-out array's adjoint is carried: the cotangent buffer is aliased to ``x``'s adjoint and seen by Warp as
        ``y``'s ``grad``; Warp's adjoint of the store reads and zeroes ``y``'s element, then the reads of ``x``
        add into the same element, so the adjoint needs neither a zeroed buffer of its own nor a copy into the
        backward loop's carry. Both are exact when each thread touches only its own element of both, every
        read of ``x`` comes before the store (forward: a thread reads its element before it overwrites it;
        backward: Warp's reverse pass runs the store's adjoint first), and the store is the one access of
        ``y``, on every path: a float input read only at the thread's ``wp.tid()`` index, outside loops and
        @wp.funcs; a float output of the same type stored once, at the top level, at that index, after those
        reads. Found conservatively in the source; ``in_place_pairs_for`` adds the conditions on shapes.
        """
        if self._base is not self:
            return self._base.in_place_pairs
        private, _ = self.thread_private_arrays
        fully_written = set(self.outputs_fully_written)

        def plain(use: ArrayUse) -> bool:
            return use.undecided is None and not use.viewed and bool(use.accesses) and all(
                a.own_element and not a.loops and a.via is None for a in use.accesses)

        pairs = []
        for y in self.outputs:
            use_y = self.uses[y.name]
            if not (y.is_float and y.name in fully_written and y.name in private and plain(use_y)
                    and len(use_y.accesses) == 1 and use_y.accesses[0].kind == "store" and use_y.accesses[0].top_level):
                continue
            for x in self.input_leaves:
                use_x = self.uses.get(x.name)
                if (x.is_array and x.is_float and "." not in x.name and x.name not in self.in_out_names
                        and x.name in private and (x.warp_type.dtype, x.warp_ndim) == (y.warp_type.dtype, y.warp_ndim)
                        and use_x is not None and plain(use_x) and all(a.kind == "read" for a in use_x.accesses)
                        and max(a.order for a in use_x.accesses) < use_y.accesses[0].order):
                    pairs.append((x.name, y.name))
        return tuple(pairs)

    def in_place_pairs_for(self, shapes: dict[str, tuple[int, ...]], launch_dims: tuple[int, ...]) -> tuple[tuple[str, str], ...]:
        """The pairs of ``in_place_pairs`` this call can use: each output with the first input (in signature
        order) that is differentiated in this call (for an adjoint; any float input for a forward), of the
        output's shape, both covering the launch (each element is one thread's); each input and output in one
        pair at most. ``shapes``: every array input's and output's shape in this call (JAX's, per vmap element)."""
        computed = {s.name for s in self.adjoint_inputs}
        taken: set[str] = set()
        pairs = []
        by_name = {s.name: s for s in (*self.input_leaves, *self.outputs)}
        for x, y in self.in_place_pairs:
            if x in taken or y in taken or x not in computed or shapes.get(x) != shapes.get(y):
                continue
            if tuple(shapes[y][: by_name[y].warp_ndim]) != tuple(launch_dims):
                continue
            pairs.append((x, y))
            taken |= {x, y}
        return tuple(pairs)

    def variant(self, constant_inputs: frozenset[str] | None = None, null_inputs: frozenset[str] | None = None,
                adjoints_in_place: tuple[tuple[str, str], ...] | None = None) -> KernelSignature:
        """This signature with other constant (non-differentiated) inputs, ``None`` inputs or adjoints computed
        in place (``in_place_pairs_for``); one instance each.

        Constant inputs get a null adjoint array, and Warp's adjoint kernel skips the atomic adds into a null
        array, so an input that is not differentiated costs no memory traffic backward. Names of inputs that
        have no adjoint anyway (integer arrays, scalars) are ignored.
        """
        differentiable = {a.name for a in self.input_leaves if a.is_array and a.is_float}
        constant = self.constant_inputs if constant_inputs is None else frozenset(constant_inputs) & differentiable
        nulls = self.null_inputs if null_inputs is None else frozenset(null_inputs)
        in_place = self.adjoints_in_place if adjoints_in_place is None else tuple(adjoints_in_place)
        if (constant, nulls, in_place) == (self.constant_inputs, self.null_inputs, self.adjoints_in_place):
            return self
        base = self._base
        key = (constant, nulls, in_place)
        found = base._variants.get(key)
        if found is None:
            found = base._variants[key] = dataclasses.replace(base, constant_inputs=constant, null_inputs=nulls,
                                                              adjoints_in_place=in_place)
            found.__dict__["_base"] = base
        return found

    def without_adjoints(self, names: frozenset[str]) -> KernelSignature:
        """This signature with no adjoint computed for the inputs ``names`` as well (see ``variant``)."""
        differentiable = {a.name for a in self.input_leaves if a.is_array and a.is_float}
        return self.variant(constant_inputs=(frozenset(names) & differentiable) | self.constant_inputs)

    @functools.cached_property
    def _base(self) -> KernelSignature:
        return self

    @functools.cached_property
    def _variants(self) -> dict[tuple[frozenset[str], frozenset[str], tuple[tuple[str, str], ...]], KernelSignature]:
        return {}

    @property
    def has_adjoint(self) -> bool:
        """Whether Warp generates this kernel's adjoint (``enable_backward`` of the kernel, else its module).

        A kernel without one still runs forward (integer-only kernels such as neighbour searches often opt
        out to compile faster); only differentiating it is an error.
        """
        return warp_builds_adjoint(self.kernel)

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
        ndims = {a.name: a.warp_ndim for a in (*self.inputs, *self.outputs) if a.is_array}
        names = list(ndims)
        try:
            private, assigned = _slice_access(self.kernel.adj.tree, names, ndims)
        except Exception:  # noqa: BLE001 - no source tree: nothing is private, everything may be assigned
            return frozenset(), frozenset(names)
        # The slice analysis reads the kernel's own body; the uses analysis (zeroing, in-out arrays) also follows
        # calls into @wp.funcs. An array that either finds stored, or that the uses analysis cannot decide about,
        # is assigned (never summed), and an undecided one is not private: the two never disagree in the unsafe
        # direction (tests/test_batched.py checks that the slice analysis alone already agrees with the uses
        # analysis on every kernel of the suite, warpnn's and Newton's).
        undecided = {n for n in names if n in self.uses and self.uses[n].undecided is not None}
        stored = {n for n in names if n in self.uses and self.uses[n].stores}
        return private - undecided, assigned | stored | undecided

    @functools.cached_property
    def thread_row_windows(self) -> dict[str, tuple[str, ...]]:
        """For arrays a thread touches only at rows it read from integer arrays: those index arrays, by array.

        ``ij = springs[s]; i = ij[0]; wp.atomic_add(f, i, fs)``: every access of ``f`` (and, in the adjoint,
        of ``x`` read as ``x[i]``) has as its first index a value read from the thread's own rows of ``springs``
        (its first ``wp.tid()`` coordinate; each name bound once, row vectors never written). A slice of the
        launch then touches only the rows between the smallest and the largest value in its rows of
        ``springs``, so its partial buffer needs zeroing and summing there only (``warpnn_ffi.c``). Index arrays
        are pure integer inputs. Found conservatively in the source; struct fields get none.
        """
        results = {a.name for a in (*self.in_out, *self.outputs)}
        index_arrays = {a.name: a for a in self.inputs
                        if a.is_array and not a.is_struct and a.dtype is not None and a.dtype.kind == "i"
                        and a.name not in results}
        try:
            return _row_windows(self.kernel.adj.tree, [a.name for a in (*self.inputs, *self.outputs) if a.is_array],
                                index_arrays)
        except Exception:  # noqa: BLE001 - no source tree: no windows (whole partial buffers)
            return {}

    @functools.cached_property
    def input_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.inputs)

    @functools.cached_property
    def output_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.outputs)

    @functools.cached_property
    def result_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.results)


_ATOMIC_CALLS = {"atomic_add", "atomic_sub", "atomic_min", "atomic_max"}
_METADATA_ATTRS = {"shape", "ndim", "strides", "size"}


def _bindings(fn: ast.FunctionDef) -> collections.Counter:
    """How many times each plain name is bound in ``fn`` (assignments, augmented assignments, loop targets)."""
    count: collections.Counter = collections.Counter()
    for n in ast.walk(fn):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign, ast.For)) else []
        for t in targets:
            count.update(e.id for e in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(e, ast.Name))
    return count


def _first_coordinate(fn: ast.FunctionDef, bindings: collections.Counter) -> str | None:
    """The name of the first ``wp.tid()`` coordinate (``i = wp.tid()``, ``i, j = wp.tid()`` at the top level),
    if it is bound only there: a name bound again no longer names this thread's slice."""
    for stmt in fn.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call):
            func = stmt.value.func
            if getattr(func, "attr", getattr(func, "id", None)) == "tid" and len(stmt.targets) == 1:
                target = stmt.targets[0]
                lead = target.elts[0] if isinstance(target, ast.Tuple) and target.elts else target
                return lead.id if isinstance(lead, ast.Name) and bindings[lead.id] == 1 else None
    return None


def _first_index(index: ast.AST) -> ast.AST:
    return index.elts[0] if isinstance(index, ast.Tuple) and index.elts else index


def _indexed_uses(fn: ast.FunctionDef, key) -> tuple[set[int], dict[str, set]]:
    """The Name nodes of arrays used through a first index that ``key`` accepts (``a[index, ...]``,
    ``wp.atomic_add(a, index, ...)``; ``key(index)`` not None) or measured (``a.shape``), and the keys by array."""
    uses: set[int] = set()
    keys: dict[str, set] = {}
    for n in ast.walk(fn):
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and key(n.slice) is not None:
            uses.add(id(n.value))
            keys.setdefault(n.value.id, set()).add(key(n.slice))
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.attr in _METADATA_ATTRS:
            uses.add(id(n.value))
        elif isinstance(n, ast.Call) and len(n.args) >= 2 and isinstance(n.args[0], ast.Name):
            if getattr(n.func, "attr", getattr(n.func, "id", None)) in _ATOMIC_CALLS and key(n.args[1]) is not None:
                uses.add(id(n.args[0]))
                keys.setdefault(n.args[0].id, set()).add(key(n.args[1]))
    return uses, keys


def _name_ids(fn: ast.FunctionDef) -> dict[str, list[int]]:
    """The ids of ``fn``'s Name nodes, by name (one walk: the analyses ask about every parameter, and walking
    mujoco_warp's long kernels once per name took seconds per traced step)."""
    names: dict[str, list[int]] = {}
    for n in ast.walk(fn):
        if isinstance(n, ast.Name):
            names.setdefault(n.id, []).append(id(n))
    return names


def _only_used_in(mentions: dict[str, list[int]], name: str, nodes: set[int]) -> bool:
    """Whether every mention of ``name`` (``mentions``: ``_name_ids`` of the function) is one of ``nodes`` (by id)."""
    return all(i in nodes for i in mentions.get(name, ()))


def _row_windows(tree: ast.AST, names: list[str], index_arrays: dict[str, ArgSpec]) -> dict[str, tuple[str, ...]]:
    """See ``KernelSignature.thread_row_windows``."""
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    bindings = _bindings(fn)
    first = _first_coordinate(fn, bindings)
    if first is None or not index_arrays:
        return {}

    def own_rows(node: ast.AST) -> str | None:
        """``idx[first, ...]`` over a whole element of an index array: the array's name."""
        if not (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in index_arrays):
            return None
        lead = _first_index(node.slice)
        coords = len(node.slice.elts) if isinstance(node.slice, ast.Tuple) else 1
        own = isinstance(lead, ast.Name) and lead.id == first
        return node.value.id if own and coords == index_arrays[node.value.id].warp_ndim else None

    rows: dict[str, str] = {}  # names bound to one row vector of an index array (`ij = springs[s]`): its array
    values: dict[str, tuple[str, str | None]] = {}  # names bound to one integer of the thread's rows: (array, row vector)
    singles = [n for n in ast.walk(fn) if isinstance(n, ast.Assign) and len(n.targets) == 1
               and isinstance(n.targets[0], ast.Name) and bindings[n.targets[0].id] == 1]
    for _ in range(2):  # row vectors, then their components, whatever the order of the statements
        for n in singles:
            name, value = n.targets[0].id, n.value
            source = own_rows(value)
            if source is not None:
                if index_arrays[source].inner_shape:
                    rows[name] = source
                else:
                    values[name] = (source, None)
            elif isinstance(value, ast.Subscript) and not isinstance(value.slice, ast.Tuple):
                inner = value.value  # `ij[k]` of a row vector, or `springs[s][k]`
                if isinstance(inner, ast.Name) and inner.id in rows:
                    values[name] = (rows[inner.id], inner.id)
                elif (array := own_rows(inner)) is not None and index_arrays[array].inner_shape:
                    values[name] = (array, None)
    # A row vector that is written (`ij[0] = ...`) or used other than read by component holds other values.
    component_reads = {id(n.value) for n in ast.walk(fn) if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Load)}
    changed = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id in rows
               and not isinstance(n.ctx, ast.Store) and id(n) not in component_reads}
    index_of = {name: array for name, (array, vector) in values.items() if vector not in changed}

    def index_source(index: ast.AST) -> str | None:
        lead = _first_index(index)
        return index_of.get(lead.id) if isinstance(lead, ast.Name) else None

    allowed, sources = _indexed_uses(fn, index_source)
    mentions = _name_ids(fn)
    return {name: tuple(sorted(sources[name])) for name in names if name in sources and _only_used_in(mentions, name, allowed)}


def _slice_access(tree: ast.AST, names: list[str], ndims: dict[str, int] | None = None) -> tuple[frozenset[str], frozenset[str]]:
    """See ``KernelSignature.thread_private_arrays``. ``ndims``: the arrays' Warp ranks, where known: a subscript with
    fewer indices is a view (``row = x[k]``), which the kernel may store through (``row[0] = v``)."""
    ndims = ndims or {}

    def whole_element(n: ast.Subscript) -> bool:
        count = len(n.slice.elts) if isinstance(n.slice, ast.Tuple) else 1
        return count >= ndims.get(n.value.id, 0)

    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    first = _first_coordinate(fn, _bindings(fn))

    def own(index: ast.AST) -> bool | None:
        lead = _first_index(index)
        return True if first is not None and isinstance(lead, ast.Name) and lead.id == first else None

    allowed, _ = _indexed_uses(fn, own)  # Name nodes used in a private way
    # Only sums may go through partial buffers: an array used other than read, added into (`a[i] += v`,
    # wp.atomic_add / atomic_sub) or measured is assigned: stored into (`a[i] = v`, atomic_min / max / exch /
    # cas), or maybe stored into elsewhere, e.g. by a @wp.func it is passed to (Newton's integrate_generalized_joints
    # writes joint_q_new inside jcalc_integrate), or through a view of it (`row = a[k]; row[0] = v`).
    summed: set[int] = set()  # ids of Name nodes read, added into or measured
    for n in ast.walk(fn):
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and isinstance(n.ctx, ast.Load) and whole_element(n):
            summed.add(id(n.value))
        elif isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Subscript) and isinstance(n.target.value, ast.Name):
            summed.add(id(n.target.value))
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.attr in _METADATA_ATTRS:
            summed.add(id(n.value))
        elif isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Name):
            if getattr(n.func, "attr", getattr(n.func, "id", None)) in ("atomic_add", "atomic_sub"):
                summed.add(id(n.args[0]))
    mentions = _name_ids(fn)
    assigned = frozenset(name for name in names if not _only_used_in(mentions, name, summed))
    private = frozenset(name for name in names if _only_used_in(mentions, name, allowed))
    return private, assigned


# --------------------------------------------------------------------------------------------------
# What a kernel does with each array parameter: the one analysis behind zeroing, in-out arrays, the
# input-write check, reverse-mode correctness and launch-vs-shape checks.

_SIGNATURES: dict[tuple, KernelSignature] = {}


def signature_of(kernel: Any, num_outputs: int, in_out_argnames=(), block_dim: int | None = None) -> KernelSignature:
    """Parse (once) and return the signature of ``kernel``.

    As in ``wp.jax_kernel``: the last ``num_outputs`` parameters are results, and ``num_outputs`` counts the
    in-out arrays ``in_out_argnames`` too, which are passed as inputs and must come before the pure outputs.
    """
    if not isinstance(kernel, wp.Kernel):
        raise TypeError(
            f"warpnn.jax_kernel expects a Warp kernel (a function decorated with @wp.kernel), "
            f"got {type(kernel).__name__}."
        )
    in_out_argnames = tuple(in_out_argnames or ())
    cpu_blocks = bool(wp.config.enable_cpu_blocks) if block_dim is not None else None  # changes the CPU build
    cache_key = (id(kernel), num_outputs, in_out_argnames, block_dim, cpu_blocks)
    cached = _SIGNATURES.get(cache_key)
    if cached is not None and cached.kernel is kernel:
        return cached

    params = kernel.adj.args
    specs = [_arg_spec(a.label, a.type, kernel.key) for a in params]
    labels = [a.label for a in params]
    if len(set(in_out_argnames)) != len(in_out_argnames):
        raise ValueError(f"Kernel '{kernel.key}': in_out_argnames={list(in_out_argnames)} names an argument twice (in_out_argnames must not contain duplicate names).")
    unknown = [n for n in in_out_argnames if n not in labels]
    if unknown:
        raise ValueError(
            f"Kernel '{kernel.key}': in_out_argnames {unknown} are not parameters of the kernel (they did not match any "
            f"function argument names); its parameters are {labels}."
        )
    n_in_out = len(in_out_argnames)
    if (not isinstance(num_outputs, int) or isinstance(num_outputs, bool)
            or not max(1, n_in_out) <= num_outputs <= len(params)):
        raise ValueError(
            f"num_outputs={num_outputs!r} for kernel '{kernel.key}', whose parameters are {labels}. num_outputs counts "
            f"the results at the end of the signature, in-out arrays included ({n_in_out} here), and must be between "
            f"{max(1, n_in_out)} and {len(params)}."
        )
    n_pure = num_outputs - n_in_out
    inputs, outputs = tuple(specs[: len(specs) - n_pure]), tuple(specs[len(specs) - n_pure :])
    for spec in outputs:
        if spec.name in in_out_argnames:
            raise ValueError(
                f"Kernel '{kernel.key}': in-out argument '{spec.name}' comes after the inputs. As in wp.jax_kernel, "
                f"in-out arrays are passed as inputs, so they must precede the {n_pure} pure output(s) (in_out "
                f"arguments should be placed before output-only arguments) "
                f"{[o.name for o in outputs]} in the kernel signature; with num_outputs={num_outputs} and "
                f"{n_in_out} in-out array(s), the pure outputs are the last {n_pure} parameters."
            )
        if not spec.is_array:
            raise TypeError(
                f"Kernel '{kernel.key}': output argument '{spec.name}' is a {spec.describe()}, but "
                f"outputs must be arrays. With num_outputs={num_outputs} the outputs are "
                f"{[o.name for o in outputs]}; lower num_outputs or make '{spec.name}' a wp.array."
            )
    for spec in inputs:
        if spec.name in in_out_argnames and not spec.is_array:
            raise TypeError(f"Kernel '{kernel.key}': in-out argument '{spec.name}' is a scalar; in-out arguments are arrays.")
    sig = KernelSignature(kernel, inputs, outputs, in_out_argnames, block_dim)
    _SIGNATURES[cache_key] = sig
    return sig


# --------------------------------------------------------------------------------------------------
# Queries for callers that replay launches of arbitrary kernels (the launch tracer), over the same analysis.


def kernel_array_uses(kernel: Any) -> dict[str, ArrayUse]:
    """How ``kernel`` uses each of its array parameters (``ArrayUse``), whatever its inputs / outputs split.

    The launch tracer asks this of every kernel a traced function launches, before it knows which arguments
    will be results; the analysis is ``analyse_array_uses``, the one behind zeroing and in-out checks.
    """
    cached = _KERNEL_USES.get(id(kernel))
    if cached is not None and cached[0] is kernel:
        return cached[1]
    uses = analyse_array_uses(kernel, _kernel_specs(kernel))
    _KERNEL_USES[id(kernel)] = (kernel, uses)
    return uses


def _kernel_specs(kernel: Any) -> list[ArgSpec]:
    """``ArgSpec`` s of ``kernel``'s array parameters (arrays of structs by name and rank only)."""
    specs = []
    for a in kernel.adj.args:
        if wc.matches_array_class(a.type, wp.array):
            try:
                specs.append(_arg_spec(a.label, a.type, kernel.key))
            except TypeError:  # an array of structs: analysed by name and rank only
                specs.append(ArgSpec(a.label, a.type, True, a.type.ndim, (), np.dtype(np.uint8)))
    return specs


_KERNEL_USES: dict[int, tuple[Any, dict[str, ArrayUse]]] = {}


def fully_written(kernel: Any, name: str) -> bool:
    """Whether every thread of ``kernel`` stores ``name[tid...]`` on every path (see ``outputs_fully_written``)."""
    try:
        return _fully_written(kernel.adj.tree, name)
    except Exception:  # noqa: BLE001 - no source tree: not provably written
        return False
