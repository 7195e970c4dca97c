"""Adjoint twins that spread a shared parameter's adjoint over many addresses, for GPU launches.

A kernel that reads a small parameter at a constant index in every thread (``alpha[0]`` in a diffusion stencil, a
learnable stiffness ``k[0]``) gets from Warp's adjoint one atomic add per thread into that one element. On a GPU
those adds queue on one address in the L2 cache: on an H200 a 1024² heat stencil's backward step took 1.9 ms for
its million adds into ``alpha``, 63× pure JAX's (docs/benchmarks-speed-gpu.md). The twin built here reads
``alpha__wnspread[slot, 0]`` instead, where ``alpha__wnspread`` holds up to :data:`SLOTS` copies of ``alpha`` and
``slot`` comes from the thread's coordinates (neighbouring threads, neighbouring slots: a warp's adds land on one
cache line), and the bridge adds the slots' adjoints into ``alpha``'s. The forward values are the same (the copies
are exact); the gradient is the same sum in another order, which on a GPU has no fixed order anyway. Compiled from
the kernel's source into a module of its own, like the other twins (the user's module is never touched).

The forward has the same problem with a small output every thread accumulates into at a constant index (a loss
written as ``wp.atomic_add(loss, 0, v)``): its twin adds into ``loss__wnspread[slot, 0]`` and the bridge sums the
copies into ``loss``. Its adjoint needs no twin: Warp's adjoint of an atomic add only reads ``loss``'s adjoint.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import math

import jax
import jax.numpy as jnp

from . import _batched, _settings, _twins
from ._access import _callee_name
from ._signature import KernelSignature, signature_of

# Copies of a spread parameter: one per THREADS_PER_SLOT threads, at most SLOTS. Measured on an H200
# (docs/benchmarks-speed-gpu.md, "What we measured"): the heat stencil's backward scan was fastest
# with 4096 copies from 512² (262,144 threads) up; 1024 copies cost 1.30 against 1.23 ms at 512², 2.20 against
# 1.91 at 1024²; fewer copies than threads / 64 left the adds queueing, more gained nothing.
SLOTS = 4096
THREADS_PER_SLOT = 64
# Launches smaller than this keep Warp's adjoint as it is. On an H200 spreading paid at the smallest launch measured,
# 1,024 threads (a 32² stencil's 50-step backward scan: 0.95 against 1.60 ms).
MIN_THREADS = 1 << 10
MAX_ELEMENTS = 64  # elements of a parameter that is spread (each slot holds a whole copy)
_PREFIX = "wnspread_"
_SUFFIX = "__wnspread"


SPREAD_ENV = "WARPNN_SPREAD"  # "0": never (Warp's own code), "1": wherever possible; unset: where it pays
_override: bool | None = None


def pays(launch_dims: tuple[int, ...]) -> bool:
    """Whether to spread for a launch over ``launch_dims``: on a GPU (a CPU thread adds in order, and the CPU's row
    loop already keeps such an adjoint in a register: ``_batched._hoisted_reads``), for big launches; ``override``
    and then ``WARPNN_SPREAD`` decide first."""
    if _override is not None:
        return _override
    setting = _settings.get(SPREAD_ENV)
    if setting is not None:
        return setting
    return jax.default_backend() != "cpu" and math.prod(launch_dims) >= MIN_THREADS


@contextlib.contextmanager
def override(spread: bool | None):
    """Within this block, calls traced are spread wherever possible (True), never (False), or where it pays (None):
    for tests on the CPU, and for benchmarks against Warp's own code. The choice is made while tracing (JAX reuses
    a traced call: ``jax.clear_caches()`` between choices)."""
    global _override
    before, _override = _override, spread
    try:
        yield
    finally:
        _override = before


def spread_name(name: str) -> str:
    """The twin's parameter holding the copies of array ``name``."""
    return f"{name}{_SUFFIX}"


def spread_inputs(sig: KernelSignature, shapes: dict[str, tuple[int, ...]]) -> tuple[str, ...]:
    """The differentiated inputs of ``sig`` that its twin would spread in a call with these array ``shapes`` (JAX's,
    by name): float arrays of at most :data:`MAX_ELEMENTS` elements that the kernel only reads element by element in
    its own body (no store, atomic, view or @wp.func taking them), at least once at constant indices. Found
    conservatively in the source; () where the twin cannot be built."""
    if type(sig) is not KernelSignature:
        return ()  # (checked mode's signatures keep their own kernel)
    candidates = _found_once(sig, _candidates)
    differentiated = {s.name for s in sig.adjoint_inputs}
    return tuple(n for n in candidates if n in differentiated and math.prod(shapes[n]) <= MAX_ELEMENTS)


def spread_outputs(sig: KernelSignature, shapes: dict[str, tuple[int, ...]]) -> tuple[str, ...]:
    """The pure outputs of ``sig`` that its forward twin would spread in a call with these array ``shapes``: float
    arrays of at most :data:`MAX_ELEMENTS` elements that the kernel only accumulates into, with
    ``wp.atomic_add``/``wp.atomic_sub`` at constant indices, their result unused, and never reads or stores."""
    if type(sig) is not KernelSignature:
        return ()
    return tuple(n for n in _found_once(sig, _output_candidates) if math.prod(shapes[n]) <= MAX_ELEMENTS)


def _found_once(sig: KernelSignature, find) -> tuple[str, ...]:
    """``find(base)`` for ``sig``'s base signature, computed once per base (its variants share the source)."""
    base = sig._base
    found = base.__dict__.setdefault("_spread_found", {})
    if find not in found:
        found[find] = find(base)
    return found[find]


def with_spread(sig: KernelSignature, inputs: tuple[str, ...] = (), outputs: tuple[str, ...] = ()) -> KernelSignature:
    """The signature of ``sig``'s spread twin: its parameters with one array per name in ``inputs`` before the pure
    outputs and one per name in ``outputs`` after them (``spread_name``: shape ``(slots, *shape)``; the inputs'
    hold ``spread_copies``, the outputs' are summed over the slots by the caller), with the same constant and
    ``None`` inputs."""
    n_pure = len(sig.outputs)
    twin = _spread_kernel(sig.kernel, inputs, outputs, n_pure)
    twin_sig = signature_of(twin, num_outputs=n_pure + len(outputs) + len(sig.in_out_names),
                            in_out_argnames=sig.in_out_names, block_dim=sig.block_dim)
    return twin_sig.variant(constant_inputs=sig.constant_inputs, null_inputs=sig.null_inputs)


def slots_for(launch_dims: tuple[int, ...], elements: int = 1) -> int:
    """Copies for a launch over ``launch_dims`` of spread inputs of ``elements`` elements in all: a power of two, one
    per :data:`THREADS_PER_SLOT` threads, 32 to :data:`SLOTS` (the twin reads the count from its operand's shape, so
    one build serves every count). The copies of all inputs hold at most one element per 16 threads (beyond the
    32 copies every launch gets): the memory stays a small fraction of the launch's own, also under ``vmap``, where
    every batch element gets copies of its own."""
    wanted = max(1, math.prod(launch_dims) // max(THREADS_PER_SLOT, 16 * elements))
    return max(32, min(SLOTS, 1 << (wanted.bit_length() - 1)))


def spread_copies(value: jax.Array, slots: int) -> jax.Array:
    """The twin's operand for a spread input ``value``: ``slots`` copies of it."""
    return jnp.broadcast_to(value, (slots, *value.shape))


def _eligible_body(sig: KernelSignature) -> ast.FunctionDef | None:
    """The kernel's function definition, if a spread twin can be built from it."""
    kernel = sig.kernel
    fn = _batched.kernel_body(kernel, _PREFIX)
    options = {**kernel.module.options, **kernel.options}
    if fn is None or options.get("block_dim", 1) not in (1, 256) or kernel.options.get("block_dim") is not None:
        return None  # tiles and cooperative blocks: wp.tid() means something else there
    try:
        _batched._check_no_block_builtins(fn)
    except _batched._Refused:
        return None
    return fn


def _candidates(sig: KernelSignature) -> tuple[str, ...]:
    fn = _eligible_body(sig)
    if fn is None:
        return ()
    ndims = {a.name: a.warp_ndim for a in (*sig.inputs, *sig.outputs) if a.is_array and "." not in a.name}
    read_only = _batched._read_only_arrays(fn.body, ndims)
    constant_reads = {node.value.id for node in ast.walk(fn)
                      if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                      and isinstance(node.ctx, ast.Load) and node.value.id in ndims
                      and len(_batched._constant_index(node) or ()) == ndims[node.value.id]}
    return tuple(s.name for s in sig.inputs
                 if s.is_array and s.is_float and s.name in ndims and s.name not in sig.in_out_names
                 and s.name in read_only and s.name in constant_reads and _copyable(sig, s, "read"))


def _copyable(sig: KernelSignature, spec, kind: str) -> bool:
    """Whether the twin can give array ``spec`` a dim of copies, and the uses analysis (which also follows calls
    into @wp.funcs) agrees that every access of it is a ``kind`` in the kernel's own body."""
    use = sig.uses.get(spec.name)
    return (spec.warp_ndim < _batched._MAX_DIMS and spread_name(spec.name) not in {p.label for p in sig.kernel.adj.args}
            and use is not None and use.undecided is None and not use.viewed
            and all(a.kind == kind and a.via is None for a in use.accesses))


def _constant_accumulation(node: ast.AST, ndims: dict[str, int]) -> str | None:
    """The array ``name`` of a ``wp.atomic_add(name, 0, v)`` / ``atomic_sub`` call at constant indices (one per
    dim), else None."""
    if not (isinstance(node, ast.Call) and _callee_name(node.func) in ("atomic_add", "atomic_sub") and node.args
            and isinstance(node.args[0], ast.Name) and node.args[0].id in ndims and not node.keywords):
        return None
    name = node.args[0].id
    index = node.args[1:-1]
    if len(index) != ndims[name] or _batched._constant_indices(index) is None:
        return None
    return name


def _output_candidates(sig: KernelSignature) -> tuple[str, ...]:
    fn = _eligible_body(sig)
    if fn is None:
        return ()
    ndims = {a.name: a.warp_ndim for a in sig.outputs if a.is_array and "." not in a.name}
    # every mention of the array: the first argument of an unused atomic add at constant indices
    allowed: set[int] = set()
    accumulated: set[str] = set()
    for stmt in ast.walk(fn):
        if isinstance(stmt, ast.Expr) and (name := _constant_accumulation(stmt.value, ndims)) is not None:
            allowed.add(id(stmt.value.args[0]))  # type: ignore[attr-defined]
            accumulated.add(name)
    mentioned_otherwise = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id in ndims and id(n) not in allowed}
    return tuple(s.name for s in sig.outputs
                 if s.name in accumulated and s.name not in mentioned_otherwise and s.is_float
                 and _copyable(sig, s, "accumulate"))


class _SpreadAccumulations(ast.NodeTransformer):
    """``wp.atomic_add(loss, 0, v)`` -> ``wp.atomic_add(loss__wnspread, wnspread_slot, 0, v)`` for ``names``."""

    def __init__(self, names: tuple[str, ...], ndims: dict[str, int]):
        self.names = names
        self.ndims = ndims

    def visit_Call(self, node: ast.Call):
        name = _constant_accumulation(node, self.ndims)
        if name in self.names:
            node.args = [ast.Name(id=spread_name(name), ctx=ast.Load()), ast.Name(id=f"{_PREFIX}slot", ctx=ast.Load()),
                         *node.args[1:]]
            return node
        return self.generic_visit(node)


class _SpreadReads(ast.NodeTransformer):
    """``alpha[0]`` -> ``alpha__wnspread[wnspread_slot, 0]`` for the arrays ``names``, at constant indices."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names

    def visit_Subscript(self, node: ast.Subscript):
        if (isinstance(node.value, ast.Name) and node.value.id in self.names and isinstance(node.ctx, ast.Load)
                and _batched._constant_index(node) is not None):
            index = [ast.Name(id=f"{_PREFIX}slot", ctx=ast.Load()), *_batched._subscript_indices(node)]
            return ast.copy_location(ast.Subscript(value=ast.Name(id=spread_name(node.value.id), ctx=ast.Load()),
                                                   slice=ast.Tuple(elts=index, ctx=ast.Load()), ctx=ast.Load()), node)
        return self.generic_visit(node)


@functools.cache
def _spread_kernel(kernel, names: tuple[str, ...], outputs: tuple[str, ...], n_pure: int):
    adj = kernel.adj
    body_of = _batched.kernel_body(kernel, _PREFIX)
    assert body_of is not None  # (spread_inputs found none without one)
    fn = _twins.copy_tree(body_of, kernel)
    kernel_dim = getattr(adj, "kernel_dim", None)
    if kernel_dim is None:
        adj.get_references()  # Warp sets kernel_dim (the arity of wp.tid()) when it hashes the module
        kernel_dim = adj.kernel_dim
    kernel_dim = max(1, int(kernel_dim))
    arg_types = dict(adj.arg_types)
    arg_types.pop("return", None)
    params = list(arg_types)
    annotations = {**{n: arg_types[n] for n in params[: len(params) - n_pure]},
                   **{spread_name(n): _batched._array_type(arg_types[n], 1) for n in names},
                   **{n: arg_types[n] for n in params[len(params) - n_pure:]},
                   **{spread_name(n): _batched._array_type(arg_types[n], 1) for n in outputs}}
    coords = [f"{_PREFIX}t{k}" for k in range(kernel_dim)]
    # Threads next to each other in the last launch dim (one warp) take slots next to each other; the dim before
    # it moves the pattern, so that a launch whose last dim is short still uses many slots.
    slots = f"{_PREFIX}slots"
    slot = f"{coords[-1]} % {slots}" if kernel_dim == 1 else f"({coords[-1]} + 33 * ({coords[-2]} % {slots})) % {slots}"
    prologue = [f"{', '.join(coords)} = {_twins.WP_NAME}.tid()",
                f"{slots} = {spread_name((*names, *outputs)[0])}.shape[0]", f"{_PREFIX}slot = {slot}"]
    ndims = {n: arg_types[n].ndim for n in outputs}
    body = [_SpreadAccumulations(outputs, ndims).visit(_SpreadReads(names).visit(stmt)) for stmt in fn.body]
    name = f"{fn.name}{_SUFFIX}"
    source = "\n".join([f"def {name}({', '.join(annotations)}):", *("    " + line for line in prologue),
                        *("    " + line for line in ast.unparse(ast.Module(body=body, type_ignores=[])).splitlines())])
    # One module per set of names: a second kernel added to a loaded module would rebuild it and unload the first.
    tag = ".".join((*names, *(f"out.{n}" for n in outputs)))
    return _twins.kernel_from_source(kernel, source + "\n", name, annotations,
                                        key=f"{kernel.key}{_SUFFIX}_{tag.replace('.', '_')}",
                                        kind=f"warpnn_spread.{tag}")


__all__ = ["MAX_ELEMENTS", "MIN_THREADS", "SLOTS", "SPREAD_ENV", "THREADS_PER_SLOT", "override", "pays", "slots_for", "spread_copies", "spread_inputs", "spread_name", "spread_outputs", "with_spread"]
