"""``warpnn.trace``: record the Warp launches of a Python function once, replay them as a JAX function.

A simulator step is Python that launches many Warp kernels on arrays it keeps in objects (Newton's
``solver.step(state_in, state_out, control, contacts, dt)``). ``trace`` runs such a function once with
``wp.launch``, ``wp.copy``, ``wp.clone`` and ``array.zero_`` / ``fill_`` / ``assign`` hooked, records
every operation with the arrays it touched, and returns a :class:`WarpProgram`: a pure function of JAX
arrays that performs the same operations, each launch as one ``warpnn.jax_kernel`` call. JAX then sees
every launch, so ``grad`` (through each kernel's Warp adjoint), ``vmap``, ``lax.scan``, ``jax.checkpoint``
and XLA's CUDA graphs work on the whole step, with no Python per step.

How a recorded launch becomes a functional call (what a kernel reads and writes comes from the bridge's
analysis, ``_signature.kernel_array_uses``):

* arrays the caller names as ``inputs`` are the program's JAX arguments; every other array is a
  constant captured when it is first touched (its value before the step);
* the kernel's arguments from the first one it writes to the end are the call's results: an array every
  thread provably stores whole is a pure output; every other one (accumulated into with ``wp.atomic_add``
  / ``+=``, stored under a condition, read and written) is an in-out argument, updated from its previous
  value exactly as Warp updates it, and differentiated through the bridge's in-out adjoint;
* ``None`` for an array parameter stays ``None`` (Warp's null array; an empty output when it is a result).

Refused, with an error naming the operation and the fix: host reads of array data inside the function
(``array.numpy()``: its control flow could depend on data the replay would freeze), host-side rebuilds
of acceleration structures (``HashGrid.build``, ``Mesh.refit``, ...) unless ``frozen_host_ops=True``,
Warp's native array utilities (scans, sorts), graph capture, adjoint launches, scalar parameters after a
written array, and aliasing array views. ``wp.struct`` arguments pass as dicts of their fields. Reverse mode through a kernel that reads values
other threads write is refused by the bridge when differentiated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import warp as wp

from . import _access, _bounded, _idle, _owned, _recorded, _stage_rules, _value_args
from ._batched import with_parameters_merged, with_parameters_reordered
from ._bridge import jax_kernel, outputs_in_place_only_into
from ._signature import fully_written, kernel_array_uses, signature_of
from ._stage_rules import StageRecord, StageRule
from ._unrolled import adjoint_signature

# What the tracer refuses, with the fix. Module constants so that tests and docs can refer to them.
HOST_READ_MESSAGE = (
    "warpnn.trace: the traced function read array data to the host ({what}) while it was being traced. "
    "Its Python control flow may depend on that data, which the replay would freeze at its trace-time "
    "value. Fix: move the host read out of the traced function (read the program's outputs instead), or "
    "compute the decision inside a kernel."
)
HOST_REBUILD_MESSAGE = (
    "warpnn.trace: the traced function rebuilt a host-side structure ({what}). The replay cannot rebuild "
    "it per call: it would keep the structure built from the trace-time data. Fix: remove the rebuild "
    "from the step (for Newton, set model.particle_grid = None to drop particle self-contact, as Newton "
    "recommends for gradients), or pass frozen_host_ops=True to warpnn.trace to accept the trace-time "
    "structure for every replay."
)
CONTROL_FLOW_MESSAGE = (
    "warpnn.trace: the traced function called {what}, whose branch or iteration count is read from a device array "
    "while it runs. A replay of the recorded launches would freeze the trace-time branches and counts. Fix: "
    "trace one branch or one iteration and write the control flow in JAX (lax.cond / lax.while_loop over "
    "programs), or turn the data-dependent control flow off in the library that issues it (for mujoco_warp, "
    "a fixed iteration count)."
)
LOOP_BODY_MESSAGE = (
    "warpnn.trace: iteration {iteration} of a wp.capture_while recorded other operations than its first ({differ}). "
    "The replay runs one body as a lax.while_loop. Fix: make the loop body launch "
    "the same operations every iteration (as a CUDA graph needs), or trace with the library's fixed-count loop."
)
LOOP_UNRUN_MESSAGE = (
    "warpnn.trace: a wp.capture_while's condition was 0 when traced, so its body never ran and nothing of it was "
    "recorded; a replay could not run it for other inputs. Fix: trace from a state where the loop runs at least once."
)
LOOP_REVERSE_MESSAGE = (
    "a wp.capture_while loop (replayed as a lax.while_loop, whose trip count depends on values) has no reverse mode "
    "in JAX. Fix: differentiate the function that runs it by a warpnn.StageRule (its result's conditions), or trace "
    "with a fixed iteration count"
)
PYTHON_STATE_MESSAGE = (
    "warpnn.trace: the traced function changed Python state it closes over: {changes}. The replay runs only the "
    "recorded launches, so every replayed step would behave as the traced one did (a step counter, a cached "
    "flag), whatever that state becomes; and the inputs and outputs you named are array objects, so after a step "
    "that rebinds attributes (swapping self.state_0 and self.state_1) they no longer are what those attributes hold. "
    "warpnn put the values back. Fix: keep that state out of the step (for a swap: trace an even number of "
    "swapping steps, or copy instead of swapping), or, if neither the launches nor your inputs and outputs depend "
    "on it, name it in warpnn.trace(..., python_state=[...]) to accept it."
)
ALIASED_PARAMETERS_MESSAGE = (
    "warpnn.trace: kernel '{key}' is launched with one array as parameters {pairs}{why}, and writes it, so it reads "
    "through one parameter what it wrote through the other. warpnn could not replay that (it runs such a kernel "
    "with the parameters merged into one). Fix: pass the array once, or separate arrays."
)
UNSUPPORTED_OP_MESSAGE = (
    "warpnn.trace: the traced function called {what}, which runs outside Warp's kernel launches (native "
    "code or graph machinery) and cannot be replayed as a JAX operation. Fix: call it outside the traced "
    "function, or replace it by a kernel."
)


@dataclasses.dataclass(frozen=True)
class _ArrayInfo:
    """What the replay needs to know about one recorded Warp array."""

    key: Any
    shape: tuple[int, ...]  # the JAX shape: Warp shape + the dtype's inner dims
    dtype: np.dtype
    label: str  # how messages name it: the input name, or the first kernel argument it was passed as


@dataclasses.dataclass(frozen=True)
class _Launch:
    """One kernel launch as a ``warpnn.jax_kernel`` call.

    Results are the arrays the launch writes: in-out arrays (passed in with their previous value, so the kernel
    updates it as Warp would: accumulations, stores under a condition, reads of the old value), and pure outputs:
    arrays each thread provably stores whole, and ``None`` results (Warp's null array: an empty output). Pure
    outputs end the signature; where they did not, ``kernel`` is the launched kernel with its parameters
    reordered (``_batched.with_parameters_reordered``).
    """

    kernel: Any
    dims: tuple[int, ...]
    block_dim: int | None
    num_outputs: int  # results, in-out arrays included
    in_out_names: tuple[str, ...]
    inputs: tuple[tuple[str, Any], ...]  # the call's arguments: ("array", key) | ("none", None) | ("scalar", value)
    results: tuple[tuple[Any, str], ...]  # (key or None, param name), in the call's result order
    output_dims: tuple[tuple[str, tuple[int, ...]], ...]  # JAX shapes of the pure outputs, by name


@dataclasses.dataclass(frozen=True)
class LaunchRecord:
    """One recorded launch as the replay runs it: ``warpnn.jax_kernel(kernel, num_outputs,
    in_out_argnames=in_out_names, block_dim=block_dim)`` called with ``launch_dims=dims``. ``kernel`` may be a
    twin of the launched one with the same body (parameters reordered or merged, see :func:`warpnn.trace`)."""

    kernel: Any
    dims: tuple[int, ...]
    block_dim: int | None
    num_outputs: int
    in_out_names: tuple[str, ...]
    output_dims: tuple[tuple[str, tuple[int, ...]], ...]  # JAX shapes of the pure outputs, by name


@dataclasses.dataclass(frozen=True)
class _Copy:
    dest: Any
    src: Any
    dest_offset: int
    src_offset: int
    count: int
    warp_ndim: int  # dims before the dtype's inner dims: wp.copy counts elements of the dtype


@dataclasses.dataclass(frozen=True)
class _Fill:
    dest: Any
    value: Any  # a scalar or an element (tuple) for the dtype; 0 for zero_()


@dataclasses.dataclass(frozen=True)
class _Set:
    dest: Any
    src: Any  # another array's key (clone, assign of an array)


@dataclasses.dataclass(frozen=True)
class _LoopRecord:
    """A ``wp.capture_while``: operations ``start:end`` (its body, recorded on its first iteration) run while the
    first element of ``condition`` is not 0, as a ``lax.while_loop``. ``written``: the base keys its body writes
    (the loop's carry)."""

    start: int
    end: int
    condition: Any
    written: tuple[Any, ...]
    iterations: int  # (when traced)


def _in_place_names(kernel, args, uses) -> list[str]:
    """The arrays a launch of ``kernel`` with ``args`` reads and writes where Warp's adjoint cannot (yet) follow."""
    return [p.label for p, a in zip(kernel.adj.args, args)
            if isinstance(a, wp.array) and p.label in uses and uses[p.label].in_place_problem() is not None]


def _refused_in_reverse(kernel, uses) -> bool:
    """Whether the bridge may refuse ``kernel``'s adjoint: Warp's adjoint would be wrong somewhere in it, or an
    array it updates in place is read by another thread (a cheap look; the bridge decides per launch)."""
    return bool(_access.codegen_facts(kernel).adjoint_problems) or any(
        use.in_place_problem() is not None for use in uses.values())


def _launched_key(kernel) -> str:
    """The key of the kernel the traced function launched, for a twin a launch-time proof made of it."""
    key = kernel.key
    for mark in (_bounded.KEY_MARK, _owned.KEY_MARK, _recorded.KEY_MARK, _idle.KEY_MARK):
        key = key.split(mark)[0]
    return key


class WarpProgram:
    """A recorded Warp function as a pure JAX function ``program(inputs) -> outputs``. Create with :func:`trace`.

    ``inputs`` and the result are dicts keyed by the names given to :func:`trace`, holding JAX arrays of the
    Warp arrays' shapes (a ``wp.array(dtype=wp.vec3)`` of length n is an ``(n, 3)`` array).
    """

    def __init__(self, ops, arrays, constants, input_keys, output_keys, views=None, stages=(), loops=()):
        self._ops = tuple(ops)
        self._stages: dict[int, StageRecord] = {s.start: s for s in stages if s.end > s.start}  # by first op
        self._loops: dict[int, _LoopRecord] = {loop.start: loop for loop in loops}  # by first op
        self._views: dict[Any, Any] = dict(views or {})  # array key -> the key whose value it reshapes
        self._platform: str | None = None  # where the traced launches ran (set by trace)
        self._arrays: dict[Any, _ArrayInfo] = arrays
        # Constants some operation writes whose every byte was 0 when first touched (``_hooked_empty``) replay as
        # ``jnp.zeros`` built inside the caller's trace, so XLA writes them in place rather than copying a literal;
        # their snapshots are dropped. A zero constant nothing writes stays a constant: built inside a rollout's
        # loop, XLA would fill it again every step (it does not hoist broadcasts out of loops).
        inputs = set(input_keys.values())
        written = {self._views.get(k, k) for op in self._ops for k in _written_keys(op)}
        self._zero = frozenset(k for k, v in constants.items() if k not in inputs and k in written
                               and not np.ascontiguousarray(v).reshape(-1).view(np.uint8).any())
        self._constants_np: dict[Any, np.ndarray] = {k: v for k, v in constants.items() if k not in self._zero}
        self._constants: dict[Any, jax.Array] | None = None
        self._input_keys: dict[str, Any] = input_keys
        self._output_keys: dict[str, Any] = output_keys

    @property
    def input_specs(self) -> dict[str, jax.ShapeDtypeStruct]:
        return {n: jax.ShapeDtypeStruct(self._arrays[k].shape, self._arrays[k].dtype) for n, k in self._input_keys.items()}

    @property
    def output_specs(self) -> dict[str, jax.ShapeDtypeStruct]:
        return {n: jax.ShapeDtypeStruct(self._arrays[k].shape, self._arrays[k].dtype) for n, k in self._output_keys.items()}

    @property
    def num_launches(self) -> int:
        return sum(isinstance(op, _Launch) for op in self._ops)

    def frozen_state(self, pairs: Mapping[str, tuple[wp.array, wp.array]]) -> list[str]:
        """The names in ``pairs`` (``name: (array the step reads, array the step writes)``, e.g. a solver's
        ``state_in.joint_q`` and ``state_out.joint_q``) whose read array is a constant of this program (not an
        input) and whose written array the program changes. A rollout that feeds the written array back as the
        next read one must carry such a pair as state: the replay would read its trace-time value every step."""
        read, written = set(), set()
        for op in self._ops:
            written |= _written_keys(op)
            if isinstance(op, _Launch):
                read |= {value for kind, value in op.inputs if kind == "array"}
            elif isinstance(op, (_Copy, _Set)):
                read.add(op.src)
        base = lambda key: self._views.get(key, key)  # noqa: E731
        read, written = {base(k) for k in read}, {base(k) for k in written}
        inputs = set(self._input_keys.values())
        return [name for name, (src, dest) in pairs.items()
                if base(_array_key(src)) in read - inputs and base(_array_key(dest)) in written]

    def describe(self) -> str:
        """One line per recorded operation: what the replay does."""
        label = lambda k: self._arrays[k].label  # noqa: E731
        lines = []
        for i, op in enumerate(self._ops):
            if i in self._stages:
                stage = self._stages[i]
                lines.append(f"stage {stage.rule.key} (operations {stage.start}-{stage.end - 1}: reverse mode by its "
                             f"rule{'' if stage.refusal is None else ', refused'}):")
            if i in self._loops:
                loop = self._loops[i]
                lines.append(f"while {label(loop.condition)}[0] != 0 (wp.capture_while; operations {loop.start}-"
                             f"{loop.end - 1}, {loop.iterations} iterations when traced):")
            if isinstance(op, _Launch):
                outs = ", ".join(f"{p} {'updated' if p in op.in_out_names else '='}" for _, p in op.results)
                lines.append(f"launch {op.kernel.key} dims {op.dims}: {outs}")
            elif isinstance(op, _Copy):
                lines.append(f"copy {label(op.src)} -> {label(op.dest)}")
            elif isinstance(op, _Fill):
                lines.append(f"fill {label(op.dest)} with {op.value}")
            else:
                lines.append(f"set {label(op.dest)} = {label(op.src)}")
        return "\n".join(lines)

    def initial_inputs(self) -> dict[str, np.ndarray]:
        """The inputs' values when the function was traced (NumPy copies), e.g. to start a rollout."""
        return {n: self._constants_np[k].copy() for n, k in self._input_keys.items()}

    def _constant(self, key) -> jax.Array:
        if key in self._zero:
            info = self._arrays[key]
            return jnp.zeros(info.shape, info.dtype)
        if self._constants is None:
            self._constants = {}
        value = self._constants.get(key)
        if value is None:
            with jax.ensure_compile_time_eval():  # a concrete array, never a tracer of the current trace
                value = self._constants[key] = jnp.asarray(self._constants_np[key])
        return value

    @functools.cached_property
    def _constant_names(self) -> dict[Any, str]:
        """Each constant array's name in :meth:`constants`: its order of first use and the argument it was."""
        used = []
        for op in self._ops:
            keys = [*_array_keys(op.inputs), *(k for k, _ in op.results if k is not None)] \
                if isinstance(op, _Launch) else [getattr(op, "src", None), op.dest]
            used += [b for k in keys if k is not None and (b := self._views.get(k, k)) not in used]
        left = set(self._input_keys.values()) | self._zero
        return {k: f"{i:03d}:{self._arrays[k].label}" for i, k in enumerate(k for k in used if k not in left)}

    def constants(self) -> dict[str, jax.Array]:
        """The arrays the program reads that are not inputs (their values before the traced call), by name;
        those that were all zeros and that the program writes are left out (the replay builds them).

        A program called inside ``jax.jit`` otherwise embeds them in the compiled program as literals (JAX
        inlines closed-over arrays), which is fine for small models; for large ones, pass them as an argument
        of the jitted function and on to the call (``program(inputs, constants=c)``), so they stay device
        buffers and compile time does not grow with the model.
        """
        return {name: self._constant(key) for key, name in self._constant_names.items()}

    def __call__(self, inputs: Mapping[str, Any], constants: Mapping[str, Any] | None = None) -> dict[str, jax.Array]:
        """Replay the recorded operations on ``inputs``; ``constants``: from :meth:`constants` (optional)."""
        return self._replay(inputs, constants)

    def _check_platform(self, inputs) -> None:
        """Refuse a replay on another platform than the trace's where a launch's meaning depends on it: launches
        with thread blocks (``launch_tiled``, ``block_dim``: a CUDA block is one CPU thread; mujoco_warp traced on
        CUDA and replayed on the CPU gave NaN, silently)."""
        if self._platform is None:
            return
        concrete = [v for v in inputs.values() if isinstance(v, jax.Array) and not isinstance(v, jax.core.Tracer)]
        if concrete:
            target = next(iter(concrete[0].devices())).platform
        else:
            default = getattr(jax.config, "jax_default_device", None)
            target = default.platform if default is not None and not isinstance(default, str) else jax.default_backend()
        target = "gpu" if target in ("gpu", "cuda", "rocm") else target
        if target != self._platform:
            raise TypeError(
                f"warpnn.WarpProgram: traced from launches with thread blocks (wp.launch_tiled / block_dim) on the "
                f"{self._platform.upper()} and replayed on the {target.upper()}. What such a launch computes depends on "
                "the device, so the program replays only where it was traced. Fix: trace on the device you replay on (create the Warp "
                f"arrays there, e.g. with wp.ScopedDevice), or replay under jax.default_device on the {self._platform.upper()}."
            )

    def reverse_refusals(self) -> dict[str, str]:
        """The recorded kernels that reverse mode refuses, ``{kernel key: why}``: what ``jax.grad`` through the
        program raises at the first of them it meets, backwards from the outputs (a ``TypeError`` naming the
        kernel and the same reasons). The bridge's own decision, with each launch's scalar arguments and shapes
        (which may let a loop be unrolled for the adjoint, ``warpnn._unrolled``); a kernel is listed if any of its
        launches is refused."""
        refused: dict[str, str] = {}
        ruled = self._ruled_operations()
        for loop in self._loops.values():
            if loop.start not in ruled:
                refused[f"wp.capture_while (operations {loop.start}-{loop.end - 1})"] = LOOP_REVERSE_MESSAGE
        for i, op in enumerate(self._ops):
            stage_refusal = self._stages[i].refusal if i in self._stages else None
            if stage_refusal is not None:
                refused.setdefault(self._stages[i].rule.key, stage_refusal)
            if not isinstance(op, _Launch) or _launched_key(op.kernel) in refused or i in ruled:
                continue
            sig = signature_of(op.kernel, op.num_outputs, list(op.in_out_names), op.block_dim)
            if not sig.float_results:  # (it writes integers only: no cotangent reaches it, the bridge's VJP is zero)
                continue
            names = [spec.name for spec in sig.inputs]
            scalars = {n: v for n, (kind, v) in zip(names, op.inputs) if kind == "scalar"}
            shapes = {n: self._arrays[v].shape for n, (kind, v) in zip(names, op.inputs) if kind == "array"}
            _, reasons = adjoint_signature(sig, scalars, {**shapes, **dict(op.output_dims)})
            if reasons:
                refused.setdefault(_launched_key(op.kernel), "; ".join(reasons))
        return refused

    def _ruled_operations(self) -> set[int]:
        """The indices of the operations a stage rule differentiates (their own adjoints are not used)."""
        return {i for stage in self._stages.values() for i in range(stage.start, stage.end)}

    def equality_branches(self) -> dict[str, tuple[str, ...]]:
        """Where the kernels that reverse mode differentiates with Warp's adjoint compare floats with ``==`` or
        ``!=``, ``{kernel key: (place, ...)}``, from Warp's code generator (``_access.CodegenFacts``).

        Their gradient is right wherever the compared values differ. At exact equality it is the derivative of the
        side taken, which is wrong where the other side adds a term that vanishes there but whose derivative does
        not (``if damping != 0.0: f -= damping * v`` at damping 0: d/d(damping) is 0, not -v). So reverse mode gives
        NaN in a thread that met equality (``warpnn._equality_guard``), unless the function or kernel is declared
        with :func:`warpnn.keep_side_taken` (its places are listed all the same). Launches a stage rule replaces,
        launches refused and launches that write no floats are not listed."""
        ruled = self._ruled_operations()
        refused = self.reverse_refusals()
        found: dict[str, tuple[str, ...]] = {}
        for i, op in enumerate(self._ops):
            if not isinstance(op, _Launch) or i in ruled or _launched_key(op.kernel) in refused:
                continue
            sig = signature_of(op.kernel, op.num_outputs, list(op.in_out_names), op.block_dim)
            places = _access.codegen_facts(op.kernel).equality_branches if sig.float_results else ()
            if places:
                found[_launched_key(op.kernel)] = places
        return found

    def launches(self) -> tuple[LaunchRecord, ...]:
        """The recorded kernel launches, in order: what each replays (see :class:`LaunchRecord`)."""
        return tuple(LaunchRecord(op.kernel, op.dims, op.block_dim, op.num_outputs, op.in_out_names, op.output_dims)
                     for op in self._ops if isinstance(op, _Launch))

    def _replay(self, inputs, constants=None, on_launch=None) -> dict[str, jax.Array]:
        """``__call__``; ``on_launch(record, args)`` sees each launch's arguments before it runs (for tests that
        check each recorded launch against Warp running it)."""
        self._check_platform(inputs)
        env: dict[Any, jax.Array] = {}
        if constants is not None:
            names = self._constant_names
            if set(constants) != set(names.values()):
                raise TypeError(
                    "warpnn.WarpProgram: constants must be exactly the dict program.constants() returns "
                    f"({len(names)} arrays), got {len(constants)} entries."
                )
            env.update({key: jnp.asarray(constants[name]) for key, name in names.items()})
        missing = [n for n in self._input_keys if n not in inputs]
        unknown = [n for n in inputs if n not in self._input_keys]
        if missing or unknown:
            raise TypeError(
                "warpnn.WarpProgram: the inputs must be exactly the names given to warpnn.trace "
                f"{sorted(self._input_keys)}" + (f"; missing {missing}" if missing else "")
                + (f"; unknown {unknown}" if unknown else "")
            )
        for name, key in self._input_keys.items():
            info, value = self._arrays[key], inputs[name]
            if tuple(np.shape(value)) != info.shape or np.dtype(value.dtype) != info.dtype:
                raise TypeError(
                    f"warpnn.WarpProgram: input '{name}' must have shape {info.shape} and dtype {info.dtype.name} "
                    f"(the traced Warp array's), got shape {tuple(np.shape(value))} and dtype {np.dtype(value.dtype).name}. "
                    "To batch calls, use jax.vmap."
                )
            env[key] = jnp.asarray(value)

        self._run_ops(env, 0, len(self._ops), on_launch)
        get, _ = self._accessors(env)
        return {name: get(key) for name, key in self._output_keys.items()}

    def _run_ops(self, env: dict, start: int, end: int, on_launch=None, region=None) -> None:
        """Replay operations ``start:end`` over ``env``: a stage as its ``custom_vjp`` function, a loop as a
        ``lax.while_loop`` (``region``: the stage or loop being run, not entered again)."""
        get, put = self._accessors(env)
        index = start
        while index < end:
            inner = [r for r in (self._stages.get(index), self._loops.get(index))
                     if r is not None and r is not region and r.end <= end]
            if on_launch is not None:  # (launch by launch for a test that watches each; loops in Python)
                inner = [r for r in inner if isinstance(r, _LoopRecord)]
            if not inner:
                self._replay_op(index, get, put, on_launch)
                index += 1
                continue
            outer = max(inner, key=lambda r: (r.end, isinstance(r, StageRecord)))  # (a stage around its loop)
            if isinstance(outer, _LoopRecord):
                self._run_loop(outer, env, on_launch)
            else:
                # (named: an XLA profile of the program, forward and reverse, names each stage's operations)
                with jax.named_scope(f"stage {outer.rule.key}"):
                    results = self._stage_function(outer)(*(get(k) for k in outer.outside))
                for key, value in zip(outer.written, results):
                    put(key, value)
            index = outer.end

    def _run_loop(self, loop: _LoopRecord, env: dict, on_launch=None) -> None:
        get, _ = self._accessors(env)
        keys = loop.written

        def cond(carry):
            return carry[keys.index(loop.condition)].reshape(-1)[0] != 0

        def body(carry):
            inner = {**env, **dict(zip(keys, carry))}  # (what the body only reads comes from outside the loop)
            self._run_ops(inner, loop.start, loop.end, on_launch, region=loop)
            return tuple(inner[k] for k in keys)

        carry = tuple(get(k) for k in keys)
        if on_launch is not None:
            while bool(cond(carry)):
                carry = body(carry)
        else:
            carry = jax.lax.while_loop(cond, body, carry)
        env.update(zip(keys, carry))

    def _accessors(self, env: dict):
        """``get(key)`` and ``put(key, value)`` over ``env`` (values by base key; a view reshapes its base's)."""
        def get(key):
            base = self._views.get(key, key)
            value = env[base] if base in env else self._constant(base)
            return value if base is key else value.reshape(self._arrays[key].shape)

        def put(key, value):
            base = self._views.get(key, key)
            env[base] = value if base is key else value.reshape(self._arrays[base].shape)

        return get, put

    def _replay_op(self, index: int, get, put, on_launch=None) -> None:
        op = self._ops[index]
        if isinstance(op, _Launch):
            if on_launch is not None:
                on_launch(LaunchRecord(op.kernel, op.dims, op.block_dim, op.num_outputs, op.in_out_names, op.output_dims),
                          [_argument(kind, v, get) for kind, v in op.inputs])
            with outputs_in_place_only_into(self._dead_after[index]):
                _replay_launch(op, get, put)
        elif isinstance(op, _Copy):
            put(op.dest, _replay_copy(op, get(op.dest), get(op.src)))
        elif isinstance(op, _Fill):
            info = self._arrays[op.dest]
            put(op.dest, jnp.broadcast_to(jnp.asarray(op.value, info.dtype), info.shape))
        else:
            put(op.dest, get(op.src))

    @functools.cached_property
    def _dead_after(self) -> dict[int, frozenset[str]]:
        """For each launch, its array parameters whose values no later operation reads: the inputs a pure output
        may be written over (``_bridge.outputs_in_place_only_into``). Live, conservatively: read by any later
        operation (whatever writes it in between), a program output, read or carried anywhere in a loop around the
        launch, or a result of a stage around it."""
        base = lambda key: self._views.get(key, key)  # noqa: E731
        live = {base(k) for k in self._output_keys.values()}
        dead = {}
        for index in reversed(range(len(self._ops))):
            op = self._ops[index]
            if isinstance(op, _Launch):
                around = set(live)
                for loop in self._loops.values():
                    if loop.start <= index < loop.end:
                        around.update(loop.written, (base(k) for body_op in self._ops[loop.start:loop.end]
                                                     for k in _read_keys(body_op)))
                for stage in self._stages.values():
                    if stage.start <= index < stage.end:
                        around.update(stage.written)
                params = op.kernel.adj.args
                dead[index] = frozenset(params[i].label for i, (kind, key) in enumerate(op.inputs)
                                        if kind == "array" and base(key) not in around)
            live.update(base(k) for k in _read_keys(op))
        return dead

    def _stage_function(self, stage: StageRecord):
        """The stage as a ``jax.custom_vjp`` function of the arrays it reads (``_stage_rules.stage_function``)."""
        cache = self.__dict__.setdefault("_stage_functions", {})
        if stage.start not in cache:
            def replay(env):  # the stage's operations over the values given: keys are base keys
                self._run_ops(env, stage.start, stage.end, region=stage)
                return env

            cache[stage.start] = _stage_rules.stage_function(
                stage, replay, {k: info.dtype for k, info in self._arrays.items()})
        return cache[stage.start]


def _array_keys(specs):
    for spec in specs:
        kind, value = spec[-2], spec[-1]
        if kind == "array":
            yield value
        elif kind == "struct":
            yield from _array_keys(value)


@functools.lru_cache(maxsize=None)
def _kernel_call(kernel, num_outputs, in_out_names, block_dim):
    return jax_kernel(kernel, num_outputs, in_out_argnames=list(in_out_names), block_dim=block_dim)


def _argument(kind, value, get):
    if kind == "array":
        return get(value)
    if kind == "struct":
        return {name: _argument(k, v, get) for name, k, v in value}
    return None if kind == "none" else value


def _replay_launch(op: _Launch, get, put) -> None:
    args = [_argument(kind, v, get) for kind, v in op.inputs]
    call = _kernel_call(op.kernel, op.num_outputs, op.in_out_names, op.block_dim)
    with jax.named_scope(op.kernel.key):  # (the launch's own XLA operations, its adjoint's too, carry its name)
        results = call(*args, launch_dims=op.dims, output_dims=dict(op.output_dims) if op.output_dims else None)
    for (key, _), result in zip(op.results, results):
        if key is not None:  # a None result is Warp's null array: nothing to keep
            put(key, result)


def _replay_copy(op: _Copy, dest: jax.Array, src: jax.Array) -> jax.Array:
    # wp.copy counts elements of the dtype over the flattened arrays; vector dtypes keep their inner dims.
    inner = dest.shape[op.warp_ndim :]
    flat_dest, flat_src = dest.reshape((-1, *inner)), src.reshape((-1, *inner))
    count = op.count or min(flat_dest.shape[0] - op.dest_offset, flat_src.shape[0] - op.src_offset)
    piece = jax.lax.dynamic_slice_in_dim(flat_src, op.src_offset, count).astype(dest.dtype)
    return jax.lax.dynamic_update_slice_in_dim(flat_dest, piece, op.dest_offset, 0).reshape(dest.shape)


# --------------------------------------------------------------------------------------------------
# Recording


_TRACE_LOCK = threading.Lock()


def _jax_shape(arr: wp.array) -> tuple[int, ...]:
    dtype: Any = arr.dtype
    inner = tuple(dtype._shape_) if hasattr(dtype, "_wp_scalar_type_") else ()
    return (*arr.shape, *inner)


def _scalar_dtype(warp_dtype) -> np.dtype:
    scalar = warp_dtype._wp_scalar_type_ if hasattr(warp_dtype, "_wp_scalar_type_") else warp_dtype
    return np.dtype(wp.dtype_to_jax(scalar))


def _keys_in_order(op) -> list:
    """The array keys an operation names, in the order of its fields (deterministic, unlike the key sets)."""
    if isinstance(op, _Launch):
        return [*_array_keys(op.inputs), *(k for k, _ in op.results if k is not None)]
    return [op.src, op.dest] if isinstance(op, (_Copy, _Set)) else [op.dest]


def _renamed(value, rename: dict):
    """``value`` (an operation, or a part of one) with the array keys in ``rename`` replaced."""
    if isinstance(value, tuple):
        try:
            if value in rename:
                return rename[value]
        except TypeError:  # (unhashable contents: not a key)
            pass
        return tuple(_renamed(v, rename) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _renamed(getattr(value, f.name), rename)
                                             for f in dataclasses.fields(value) if f.init})
    return value


def _operations_differ(ops, body, label) -> str | None:
    """How a loop iteration's operations differ from its first iteration's (kernels by identity, arrays by key),
    or None."""
    for i, (a, b) in enumerate(zip(ops, body)):
        differ = _operation_differs(a, b, label)
        if differ is not None:
            return f"operation {i} of the body, {differ}"
    if len(ops) != len(body):
        return f"{len(ops)} operations, the first iteration {len(body)}"
    return None


def _operation_differs(a, b, label) -> str | None:
    def same(x, y) -> bool:
        try:
            return bool(x == y)
        except (ValueError, TypeError):  # (an argument compared elementwise: compare what they print as)
            return repr(x) == repr(y)

    if type(a) is not type(b) or (isinstance(a, _Launch) and a.kernel is not b.kernel):
        return f"{_operation_name(a)} where the first iteration had {_operation_name(b)}"
    if isinstance(a, _Launch):
        names = [arg.label for arg in a.kernel.adj.args]
        for k, (x, y) in enumerate(zip(a.inputs, b.inputs)):
            if not same(x, y):
                show = lambda v: label(v[1]) if v[0] == "array" else repr(v[1])  # noqa: E731
                return (f"{_operation_name(a)}: argument '{names[k] if k < len(names) else k}' is {show(x)}, "
                        f"on the first iteration {show(y)}")
    for field in dataclasses.fields(a):
        if not same(getattr(a, field.name), getattr(b, field.name)):
            return f"{_operation_name(a)}: its {field.name} differs"
    return None


def _operation_name(op) -> str:
    return f"launch of {op.kernel.key}" if isinstance(op, _Launch) else type(op).__name__.strip("_").lower()


def _written_keys(op) -> set:
    """The keys of the arrays a recorded operation writes: a launch's results, a copy's, fill's or set's dest."""
    return {key for key, _ in op.results if key is not None} if isinstance(op, _Launch) else {op.dest}


def _read_keys(op) -> set:
    """The keys of the arrays a recorded operation reads: a launch's array arguments (in-out ones included), a
    copy's source and destination (a copy may update part of it), a set's source."""
    if isinstance(op, _Launch):
        return set(_array_keys(op.inputs))
    if isinstance(op, _Copy):
        return {op.src, op.dest}
    return {op.src} if isinstance(op, _Set) else set()


class _Recorder:
    def __init__(self, input_arrays: Mapping[str, wp.array], frozen_host_ops: bool):
        self.ops: list = []
        # launch-time proofs (_owned.py, _bounded.py): (op index, arrays read, kernel without the proof, its twin,
        # {array: how its adjoint replays} for the arrays whose elements are owned)
        self.proofs: list[tuple[int, frozenset, Any, Any, dict[str, str]]] = []
        # launches no thread of which gets past the guards the constants decide (_idle.py): (op index, arrays read)
        self.idle: list[tuple[int, frozenset]] = []
        self.arrays: dict[Any, _ArrayInfo] = {}
        self.snapshots: dict[Any, np.ndarray] = {}
        self.frozen_host_ops = frozen_host_ops
        self.depth = 0  # >0 while a recorded operation runs (its internal launches are not recorded)
        self._nbytes: dict[Any, int] = {}
        self._objects: dict[Any, wp.array] = {}
        # another shape or dtype over exactly the memory of an array registered before (mujoco_warp reads a
        # (n,) mat33 array as (n, 3) vec3): replayed as a reshape of that array's value
        self.views: dict[Any, Any] = {}
        self.platform: str | None = None  # "cpu" or "gpu": where launches with thread blocks ran (WarpProgram._check_platform)
        self.input_keys = {}
        self.inputs_given = list(input_arrays.values())
        self.stages: list[StageRecord] = []  # traced calls of StageRules' functions (_stage_rules.py)
        self.stage_open = False
        self.launch_rules: list[tuple[Callable[[Any], bool], StageRule]] = []  # per_launch StageRules, matched
        self.loops: list[_LoopRecord] = []  # wp.capture_while loops
        for name, arr in input_arrays.items():
            if not isinstance(arr, wp.array):
                raise TypeError(
                    f"warpnn.trace: input '{name}' must be a wp.array (the array the function reads), got "
                    f"{type(arr).__name__}. Scalars passed to kernels are static: to train one, keep it in a "
                    "1-element array the kernel reads."
                )
            self.input_keys[name] = self.touch(arr, name)
            if self.input_keys[name] in self.views:
                raise TypeError(f"warpnn.trace: input '{name}' shares its memory with another input; pass separate arrays.")

    # -- arrays --------------------------------------------------------------------------------

    def register(self, arr: wp.array, label: str):
        if type(arr) is not wp.array:
            raise TypeError(
                f"warpnn.trace: argument '{label}' is a {type(arr).__name__}; only plain wp.array arguments can be "
                "replayed (not indexed or fabric arrays)."
            )
        if not arr.is_contiguous:
            raise TypeError(
                f"warpnn.trace: argument '{label}' is a non-contiguous array view (strides {arr.strides}); "
                "the replay needs contiguous arrays. Pass a contiguous array (wp.clone of the view)."
            )
        key: Any = _array_key(arr)
        if key in self.arrays:
            return key
        info = _ArrayInfo(key, _jax_shape(arr), _scalar_dtype(arr.dtype), label)
        if arr.ptr:
            start, end = arr.ptr, arr.ptr + arr.capacity
            for other in self.arrays.values():
                o: Any = other.key
                if o in self.views or not (o[0] != "empty" and o[3] == key[3] and o[0] < end and start < o[0] + self._nbytes[o]):
                    continue
                if (o[0] == start and self._nbytes[o] == arr.capacity and other.dtype == info.dtype
                        and math.prod(other.shape) == math.prod(info.shape)):
                    self.views[key] = o  # the same bytes as the same scalars: a reshape of one value
                    break
                raise TypeError(
                    f"warpnn.trace: argument '{label}' (shape {arr.shape}, {arr.dtype.__name__}) shares memory "
                    f"with '{other.label}' (part of the same allocation, or its bytes as other scalars). The replay "
                    "treats arrays as separate values; it follows only an array seen again whole as another shape "
                    "of the same scalars. Fix: use separate arrays."
                )
        self._nbytes[key] = arr.capacity
        self._objects[key] = arr
        self.arrays[key] = info
        return key

    def touch(self, arr: wp.array, label: str):
        """Register ``arr`` and keep its pre-step value (before the operation that touches it runs)."""
        key = self.register(arr, label)
        base = self._base(key)  # a view's value is its base array's
        if base not in self.snapshots:
            with self.suspended():
                self.snapshots[base] = (self._objects[base].numpy().copy() if arr.size
                                        else np.zeros(self.arrays[base].shape, self.arrays[base].dtype))
        return key

    def _base(self, key):
        """The key whose value ``key``'s array holds: its own, or for a view the base array's."""
        return self.views.get(key, key)

    @contextlib.contextmanager
    def suspended(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    # -- operations ----------------------------------------------------------------------------

    def launch(self, kernel, dim, inputs, outputs, adjoint, block_dim):
        if adjoint:
            raise TypeError(UNSUPPORTED_OP_MESSAGE.format(what=f"wp.launch(adjoint=True) of kernel '{kernel.key}'"))
        if not isinstance(kernel, wp.Kernel):
            raise TypeError(f"warpnn.trace: wp.launch got {type(kernel).__name__}, not a Warp kernel.")
        args = [*inputs, *outputs]
        if kernel.is_generic:
            kernel = kernel._add_normalized_overload(kernel.infer_argument_types(args))
        params = kernel.adj.args
        if len(args) != len(params):
            raise TypeError(f"warpnn.trace: kernel '{kernel.key}' takes {len(params)} arguments, got {len(args)}.")
        dims = (int(dim),) if isinstance(dim, (int, np.integer)) else tuple(int(d) for d in dim)
        if math.prod(dims) == 0:  # Warp launches nothing: nothing changes
            return
        merged = self._one_array_twice(kernel, args)
        if merged:
            try:
                kernel = with_parameters_merged(kernel, merged)
            except Exception as e:  # noqa: BLE001 - no source to regenerate, or a name the body rebinds
                raise TypeError(ALIASED_PARAMETERS_MESSAGE.format(
                    key=kernel.key, pairs=", ".join(f"'{d}' and '{k}'" for d, k in merged), why=f" ({e})")) from e
            dropped = {d for d, _ in merged}
            args = [a for p, a in zip(params, args) if p.label not in dropped]
            params = kernel.adj.args
        if _value_args.value_params(kernel):  # wp.vec3 (...) values: the twin taking their components
            args = _value_args.expand(kernel, args)
            kernel = _value_args.with_components(kernel)
            params = kernel.adj.args
        unrecorded = kernel, args
        if _recorded.uses_atomic_values(kernel) and _access.ATOMIC_VALUE_PROBLEM in " ".join(
                _access.codegen_facts(kernel).adjoint_problems):
            kernel, args = self._with_recorded_atomics(kernel, args, dims)
        uses = kernel_array_uses(kernel)
        if not block_dim:
            kernel, uses = self._with_launch_proofs(kernel, args, dims, uses)
        if kernel is not unrecorded[0] and _recorded.RECORD in uses and not uses[_recorded.RECORD].elements_owned:
            # (no proof that each thread reads back only its own record: the kernel as launched, and its refusal)
            kernel, args = unrecorded
            uses = kernel_array_uses(kernel)
        idle_keys = self._idle_proof(*unrecorded, dims) if not block_dim and _refused_in_reverse(kernel, uses) \
            else None
        if idle_keys is not None:
            kernel, args = unrecorded  # (replaced by its idle twin at the end of the trace: settle_proofs)
            uses = kernel_array_uses(kernel)
        params = kernel.adj.args
        is_array = [p.label in uses for p in params]
        written = [is_array[i] and uses[p.label].writes for i, p in enumerate(params)]
        if not any(written):
            return  # writes no array: nothing the replay can see
        # Results: every array the launch writes. Pure outputs are the None ones (Warp's null array: an empty
        # output) and those every thread provably stores whole; the bridge zeroes (or fully overwrites) them.
        # Every other result is in-out, updated from its previous value, and stays where it is among the inputs.
        pure = [i for i, (p, value) in enumerate(zip(params, args)) if written[i] and (value is None or (
            not uses[p.label].reads and fully_written(kernel, p.label) and tuple(value.shape) == dims))]
        if pure != list(range(len(params) - len(pure), len(params))):
            # The bridge returns the trailing parameters as pure outputs: move these to the end.
            order = [i for i in range(len(params)) if i not in pure] + pure
            try:
                labels = tuple(params[i].label for i in order)
                kernel = self._proof_reordered(kernel, with_parameters_reordered(kernel, labels), labels)
            except Exception:  # noqa: BLE001 - no source to regenerate: only the trailing run stays pure
                order = list(range(len(params)))
                while pure and pure[0] != len(params) - len(pure):
                    pure.pop(0)
            args, written, is_array = ([seq[i] for i in order] for seq in (args, written, is_array))
            params = kernel.adj.args  # the reordered kernel's (in `order`)
            pure = list(range(len(params) - len(pure), len(params)))
        first_output = len(params) - len(pure)
        in_out = [p.label for i, p in enumerate(params[:first_output]) if written[i]]
        none_in_out = [p.label for p, v in zip(params[:first_output], args[:first_output]) if p.label in in_out and v is None]
        if none_in_out:
            raise TypeError(
                f"warpnn.trace: kernel '{kernel.key}' was launched with None for {none_in_out}, which it may update "
                "in place (an in-out argument); pass an array (an empty one if the kernel tests for a null array)."
            )
        call_inputs = []
        for i, (p, value) in enumerate(zip(params[:first_output], args[:first_output])):
            if not is_array[i]:
                if hasattr(value, "_cls"):  # a wp.struct: the bridge takes a dict of its fields
                    call_inputs.append(("struct", self._struct_spec(value, p.label)))
                else:
                    call_inputs.append(("scalar", _plain_scalar(value)))
            elif value is None:
                call_inputs.append(("none", None))
            else:
                call_inputs.append(("array", self.touch(value, p.label)))
        # The call returns the in-out arrays' new values first (in signature order), then the pure outputs.
        results, output_dims = [], []
        for i in [j for j, p in enumerate(params[:first_output]) if p.label in in_out] + pure:
            p, value = params[i], args[i]
            if value is None:
                results.append((None, p.label))
                output_dims.append((p.label, self._empty_shape(p.type)))
                continue
            key = self.touch(value, p.label)
            if i >= first_output:
                output_dims.append((p.label, self.arrays[key].shape))
            results.append((key, p.label))
        self.ops.append(_Launch(kernel, dims, block_dim or None, len(results), tuple(in_out),
                                tuple(call_inputs), tuple(results), tuple(output_dims)))
        if idle_keys is not None:
            self.idle.append((len(self.ops) - 1, idle_keys))

    def _with_recorded_atomics(self, kernel, args, dims):
        """``kernel`` and ``args`` or, where the kernel uses values its atomics return (which Warp's adjoint does not
        have), its twin that records them for the adjoint (``_recorded.py``) and the arguments with the record."""
        found = _recorded.with_recorded_atomics(kernel, len(dims))
        if found is None or _access.ATOMIC_VALUE_PROBLEM in " ".join(_access.codegen_facts(found[0]).adjoint_problems):
            return kernel, args
        twin, sites = found
        device = next((a.device for a in args if isinstance(a, wp.array)), None)
        return twin, [*args, wp.zeros((*dims, sites), dtype=wp.int32, device=device)]

    def _with_launch_proofs(self, kernel, args, dims, uses):
        """``kernel`` and its uses or, where proofs from the program's constants make its adjoint right, the twin
        they allow: the elements of arrays it updates in place at computed indices placed per thread
        (``_owned.py``: mujoco_warp's ``qpos`` by joint), dynamic loops bounded by the model unrolled
        (``_bounded.py``), or both. ``settle_proofs`` checks at the end that nothing wrote the arrays they read."""
        in_place = _in_place_names(kernel, args, uses)
        with self.suspended():
            owned, read = _owned.prove(kernel, args, dims, in_place, self._constant_so_far) if in_place \
                else ({}, [])
            found = None
            # Loops bounded where the constants fix them: for the adjoint's sake, or for the in-place proof's (it
            # follows static loops only)
            if _bounded.has_dynamic_loops(kernel) and (
                    set(owned) != set(in_place) or _access.codegen_facts(kernel).adjoint_problems):
                found = _bounded.bounded(kernel, args, dims, self._constant_so_far,
                                         accept=lambda twin: self._all_owned(twin, args, dims))
        if found is not None:
            twin, read, (owned, read_by_proof) = found
            read = [*read, *read_by_proof]
            twin = _owned.with_elements_owned(twin, owned) if owned else twin
        elif owned:
            twin = _owned.with_elements_owned(kernel, owned)
        else:
            return kernel, uses
        keys = {self._base(k) for k in (self.register(a, "index array") for a in read)}
        self.proofs.append((len(self.ops), frozenset(keys), kernel, twin, owned))
        return twin, kernel_array_uses(twin)

    def _idle_proof(self, kernel, args, dims) -> frozenset | None:
        """The keys of the constant arrays that prove this launch idle (``_idle.py``), or None."""
        with self.suspended():
            found = _idle.idle(kernel, args, dims, self._constant_so_far)
        if found is None:
            return None
        return frozenset(self._base(self.register(a, "index array")) for a in found)

    def _all_owned(self, kernel, args, dims):
        """``(owned, arrays read)`` where a proof places every array ``kernel`` updates in place, else None."""
        names = _in_place_names(kernel, args, kernel_array_uses(kernel))
        if not names:
            return {}, []
        owned, read = _owned.prove(kernel, args, dims, names, self._constant_so_far)
        return (owned, read) if set(owned) == set(names) else None

    def _proof_reordered(self, kernel, reordered, labels):
        """``reordered`` (``kernel`` with its pure outputs moved last), carrying this launch's proof if it has one."""
        if self.proofs and self.proofs[-1][0] == len(self.ops) and self.proofs[-1][3] is kernel:
            index, keys, launched, _, owned = self.proofs[-1]
            _access.declare_elements_owned(reordered, frozenset(owned),
                                           frozenset(n for n, how in owned.items() if how == "outputs"))
            self.proofs[-1] = (index, keys, with_parameters_reordered(launched, labels), reordered, owned)
        return reordered

    def _constant_so_far(self, arr: wp.array) -> bool:
        """Whether ``arr`` is neither an input nor written by an operation recorded so far (an array with no
        elements, which Warp passes without memory, has no values to change)."""
        if type(arr) is wp.array and arr.size == 0:
            return not any(a is arr for a in self.inputs_given)
        if type(arr) is not wp.array or not arr.is_contiguous or not arr.ptr:
            return False
        key = self.register(arr, "index array")
        key = self._base(key)
        inputs = {self._base(k) for k in self.input_keys.values()}
        return key not in inputs and not any(key in self._written_by(op) for op in self.ops)

    def _written_by(self, op) -> set:
        """The arrays (their base arrays' keys) a recorded operation writes."""
        return {self._base(k) for k in _written_keys(op)}

    def settle_proofs(self) -> None:
        """Launch-time proofs (``_with_launch_proofs``) whose arrays a later operation wrote fall back to the
        kernel as launched (its refusal stands); launches proven idle (``_idle.py``) whose arrays no later
        operation wrote replay as their idle twins. (A later write matters where a ``wp.capture_while`` runs the
        launch again after it.)"""
        for index, keys, launched, twin, _ in self.proofs:
            if index >= len(self.ops) or getattr(self.ops[index], "kernel", None) is not twin:
                continue  # (the launch recorded nothing)
            if self._written_after(index, keys):
                self.ops[index] = dataclasses.replace(self.ops[index], kernel=launched)
        for index, keys in self.idle:
            if not self._written_after(index, keys):
                self.ops[index] = dataclasses.replace(self.ops[index], kernel=_idle.idle_twin(self.ops[index].kernel))

    def _written_after(self, index: int, keys: frozenset) -> bool:
        """Whether an operation recorded after the one at ``index`` writes any of the arrays ``keys``."""
        return any(keys & self._written_by(op) for op in self.ops[index + 1:])

    def _one_array_twice(self, kernel, args) -> tuple[tuple[str, str], ...]:
        """``(drop, keep)`` pairs of parameters the launch passes one array to, where the kernel writes either.

        Warp then reads through one parameter what the launch wrote through the other; the replay runs the kernel
        with the two merged (``_batched.with_parameters_merged``). The same memory seen as two shapes
        (``self.views``) in one launch with a write cannot be merged: refused."""
        uses = kernel_array_uses(kernel)
        by_memory: dict[Any, list[tuple[str, Any]]] = {}
        for p, value in zip(kernel.adj.args, args):
            if isinstance(value, wp.array) and value.ptr and p.label in uses:
                key = self.register(value, p.label)
                by_memory.setdefault(self._base(key), []).append((p.label, key))
        pairs = []
        for group in by_memory.values():
            if len(group) < 2 or not any(uses[name].writes for name, _ in group):
                continue
            if len({key for _, key in group}) > 1:
                raise TypeError(ALIASED_PARAMETERS_MESSAGE.format(
                    key=kernel.key, pairs=" and ".join(f"'{n}'" for n, _ in group),
                    why=" as arrays of different shapes or types over the same memory"))
            keep = next(name for name, _ in group if uses[name].writes)
            pairs += [(name, keep) for name, _ in group if name != keep]
        return tuple(pairs)

    def _struct_spec(self, value, label):
        """A struct argument as (field, kind, value) triples, arrays by key, nested structs recursively."""
        fields = []
        for name in value._cls.vars:
            field = getattr(value, name)
            if isinstance(field, wp.array):
                fields.append((name, "array", self.touch(field, f"{label}.{name}")))
            elif field is None:
                fields.append((name, "none", None))
            elif hasattr(field, "_cls"):
                fields.append((name, "struct", self._struct_spec(field, f"{label}.{name}")))
            else:
                fields.append((name, "scalar", _plain_scalar(field)))
        return tuple(fields)

    @staticmethod
    def _empty_shape(warp_type) -> tuple[int, ...]:
        dtype = warp_type.dtype
        inner = tuple(dtype._shape_) if hasattr(dtype, "_wp_scalar_type_") else ()
        return (0,) * warp_type.ndim + inner

    def copy(self, dest, src, dest_offset, src_offset, count):
        d, s = self.touch(dest, "wp.copy dest"), self.touch(src, "wp.copy src")
        self.ops.append(_Copy(d, s, int(dest_offset), int(src_offset), int(count), dest.ndim))

    def fill(self, dest, value):
        d = self.touch(dest, "filled array")
        if hasattr(value, "_wp_scalar_type_") or isinstance(value, (tuple, list, np.ndarray)):
            value = tuple(np.asarray(value, dtype=self.arrays[d].dtype).reshape(-1).tolist())
            value = np.asarray(value, dtype=self.arrays[d].dtype).reshape(self.arrays[d].shape[dest.ndim :])
        self.ops.append(_Fill(d, value))

    def set(self, dest, src):
        d, s = self.touch(dest, "cloned array"), self.touch(src, "clone source")
        self.ops.append(_Set(d, s))

    def capture_while(self, condition, while_body, kwargs) -> None:
        """Run a ``wp.capture_while`` as Warp runs it without a graph, recording its body once.

        The first iteration's operations are the loop's body; every later one must record the same operations
        (same kernels, arguments, shapes), which are then dropped: the replay is a ``lax.while_loop`` over the body
        while the condition's first element is not 0, however many iterations another input needs."""
        if not isinstance(condition, wp.array) or condition.dtype is not wp.int32 or condition.size < 1:
            raise TypeError("warpnn.trace: wp.capture_while's condition must be a Warp int32 array (its first "
                            "element is the loop's test).")
        cond = self._base(self.touch(condition, "capture_while condition"))
        start, body, first_new, iterations = len(self.ops), None, set(), 0
        label = lambda k: self.arrays[k].label  # noqa: E731
        while True:
            with self.suspended():
                wp.synchronize()
                if int(condition.numpy().reshape(-1)[0]) == 0:
                    break
            mark, stage_mark, loop_mark, known = len(self.ops), len(self.stages), len(self.loops), set(self.arrays)
            while_body(**kwargs)
            if body is None:
                body, first_new = self.ops[mark:], set(self.arrays) - known
            else:
                differ = self._same_body(self.ops[mark:], body, known, first_new, label)
                if differ is not None:
                    raise TypeError(LOOP_BODY_MESSAGE.format(iteration=iterations + 1, differ=differ))
                del self.ops[mark:], self.stages[stage_mark:], self.loops[loop_mark:]
                self.idle = [entry for entry in self.idle if entry[0] < mark]  # (their indices will be others')
            iterations += 1
        if body is None:
            raise TypeError(LOOP_UNRUN_MESSAGE)
        written = {self._base(k) for op in body for k in _written_keys(op)}
        self.loops.append(_LoopRecord(start, start + len(body), cond, tuple(sorted(written | {cond}, key=repr)),
                                      iterations))

    def _same_body(self, ops, body, known, first_new, label) -> str | None:
        """How a later iteration's operations differ from the first's, or None.

        An array the iteration allocated (not registered before it) stands for the array at the same place in
        the first iteration, if that one was allocated by the first iteration too (a scratch buffer per
        iteration; the replay carries the first's from one iteration to the next, which for a buffer read before
        it is written is one of the contents a new allocation could have). One that the body only reads must
        hold the same contents in both (an array made from host data each iteration)."""
        rename: dict = {}
        for op, first in zip(ops, body):
            if type(op) is type(first):
                for k, k1 in zip(_keys_in_order(op), _keys_in_order(first)):
                    if k != k1 and k not in known and k1 in first_new and rename.setdefault(k, k1) == k1:
                        if (self.arrays[k].shape, self.arrays[k].dtype) != (self.arrays[k1].shape,
                                                                          self.arrays[k1].dtype):
                            return f"it allocates {label(k)} with shape {self.arrays[k].shape}, the first " \
                                   f"iteration {self.arrays[k1].shape}"
        for k, k1 in rename.items():
            only_read = not any(k1 in _written_keys(op) for op in body)
            if only_read and not np.array_equal(self.snapshots[self._base(k)], self.snapshots[self._base(k1)]):
                return f"it allocates {label(k)} with other contents than the first iteration's, and reads them"
        return _operations_differ([_renamed(op, rename) for op in ops], body, label)

    def launch_rule(self, kernel) -> StageRule | None:
        """The per-launch StageRule whose kernel this is, if any (a launch inside another stage is part of it)."""
        if self.stage_open or not isinstance(kernel, wp.Kernel):
            return None
        return next((rule for matches, rule in self.launch_rules if matches(kernel)), None)

    def stage_call(self, rule: StageRule, original, args, kwargs):
        """Run a StageRule's function, recording its operations as one stage and checking its rule against them."""
        if self.stage_open:  # (a call inside another stage is part of it)
            return original(*args, **kwargs)
        named = {part: dict(getattr(rule, part)(*args, **kwargs)) for part in ("reads", "writes", "context", "ignores")}
        keys = {part: tuple((n, self._base(self.touch(a, f"{rule.key}: {n}"))) for n, a in arrays.items())
                for part, arrays in named.items()}
        with self.suspended():
            before = {n: a.numpy().copy() for n, a in named["reads"].items()}
        start = len(self.ops)
        self.stage_open = True
        try:
            result = original(*args, **kwargs)
        finally:
            self.stage_open = False
        with self.suspended():
            wp.synchronize()
            after = {n: a.numpy().copy() for n, a in (*named["writes"].items(), *named["context"].items())}
        # a per-launch rule sees the launch's scalar arguments in ``after``; its refusals name arrays by parameter
        scalars = tuple((n, _plain_scalar(v)) for n, v in kwargs.items() if rule.per_launch and _is_scalar_argument(v))
        after.update(scalars)
        refusal = _stage_rules.check(rule, before, after, list(named["writes"]))
        names = tuple((self._base(self.touch(a, n)), n) for n, a in kwargs.items() if rule.per_launch
                      and isinstance(a, wp.array))
        self.stages.append(StageRecord(rule, start, len(self.ops), keys["reads"], keys["writes"], keys["context"],
                                       ignored=frozenset(k for _, k in keys["ignores"]), refusal=refusal,
                                       names=names, scalars=scalars))
        return result

    def settle_stages(self) -> None:
        """Each stage's record with what its operations read and write (``_stage_rules.settle``)."""
        inputs = {self._base(k) for k in self.input_keys.values()}
        dtypes = {k: info.dtype for k, info in self.arrays.items()}
        labels = {k: info.label for k, info in self.arrays.items()}
        for i, record in enumerate(self.stages):
            read, written = [], []
            for op in self.ops[record.start:record.end]:
                read += [b for k in _read_keys(op) if (b := self._base(k)) not in written and b not in read]
                written += [b for k in _written_keys(op) if (b := self._base(k)) not in written]
            written_before = set().union(*(self._written_by(op) for op in self.ops[:record.start]))
            self.stages[i] = _stage_rules.settle(record, read, written, inputs, written_before, dtypes,
                                                 {**labels, **dict(record.names)})

    # -- end -----------------------------------------------------------------------------------

    def restore(self) -> None:
        """Put back every touched array's pre-trace contents: tracing must not change the caller's data."""
        for key, snap in self.snapshots.items():
            arr = self._objects[key]
            if arr.size:
                _ORIGINAL["assign"](arr, snap)


def _array_key(arr: wp.array) -> Any:
    """How the recorder names an array: its memory, shape, type and device (an empty array by identity)."""
    return (arr.ptr, tuple(arr.shape), arr.dtype, str(arr.device)) if arr.ptr else ("empty", id(arr))


def _plain_scalar(value):
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if hasattr(value, "value") and np.isscalar(value.value):  # wp.float32(...) and friends
        return _plain_scalar(value.value)
    return value  # anything else: the bridge names what it expects


# --------------------------------------------------------------------------------------------------
# Hooks


_ORIGINAL: dict[str, Callable] = {}
_ACTIVE: list[_Recorder] = []
_LAUNCH_SIG = None


def _install_hooks():
    global _LAUNCH_SIG
    if _ORIGINAL:
        return
    _ORIGINAL.update(
        launch=wp.launch, copy=wp.copy, clone=wp.clone, empty=wp.empty, zero_=wp.array.zero_, fill_=wp.array.fill_,
        assign=wp.array.assign, numpy=wp.array.numpy, list=wp.array.list, capture_while=wp.capture_while,
    )
    _LAUNCH_SIG = inspect.signature(_ORIGINAL["launch"])


def _recorder() -> _Recorder | None:
    rec = _ACTIVE[-1] if _ACTIVE else None
    return rec if rec is not None and rec.depth == 0 else None


def _check_launch_device(kernel, device, args) -> None:
    """Refuse a launch whose arrays live on another device than the launch's before Warp runs it.

    ``wp.launch`` without ``device=`` runs on Warp's default device, whatever the arrays' devices, and Warp 1.19
    does not check by default (``wp.config.launch_array_access_mode``): a CUDA launch over host arrays reads host
    pointers on the GPU (an illegal address, which leaves the CUDA context unusable for the rest of the process).
    Pinned host arrays are readable from a GPU and pass.
    """
    target = wp.get_device(device)
    for i, arr in enumerate(args):
        if isinstance(arr, wp.array) and arr.device != target and not (target.is_cuda and arr.pinned):
            name = kernel.adj.args[i].label if isinstance(kernel, wp.Kernel) and i < len(kernel.adj.args) else f"#{i}"
            raise TypeError(
                f"warpnn.trace: kernel '{getattr(kernel, 'key', kernel)}' is launched on {target} but its argument "
                f"'{name}' is an array on {arr.device}. Warp would run the launch on {target} over that array's "
                f"memory without checking (on a GPU an illegal address that ends the CUDA context). Fix: pass "
                f"device='{arr.device}' to wp.launch, or create the arrays on {target} (e.g. model.finalize(device=...))."
            )


def _hooked_launch(*args, **kwargs):
    rec = _recorder()
    if rec is not None:
        bound = _LAUNCH_SIG.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        device = a["stream"].device if a["stream"] is not None else a["device"]  # as wp.launch decides it
        _check_launch_device(a["kernel"], device, [*a["inputs"], *a["outputs"]])
        if a["block_dim"] is not None:  # thread blocks (tiles): a launch whose meaning depends on the device
            rec.platform = rec.platform or ("gpu" if wp.get_device(device).is_cuda else "cpu")
        if a["record_cmd"]:
            raise TypeError(UNSUPPORTED_OP_MESSAGE.format(
                what=f"wp.launch(record_cmd=True) of kernel '{getattr(a['kernel'], 'key', a['kernel'])}' (a Launch "
                     "object runs later, outside the recording)"))
        if a["adj_inputs"] or a["adj_outputs"]:
            raise TypeError(UNSUPPORTED_OP_MESSAGE.format(
                what=f"wp.launch of kernel '{getattr(a['kernel'], 'key', a['kernel'])}' with adjoint arrays"))

        def record_and_run(**_):
            rec.launch(a["kernel"], a["dim"], a["inputs"], a["outputs"], a["adjoint"], a["block_dim"])
            with rec.suspended():
                return _ORIGINAL["launch"](*args, **kwargs)

        rule = rec.launch_rule(a["kernel"])
        if rule is None:
            return record_and_run()
        # a per-launch StageRule: this launch is its stage; its parts see the arguments by parameter name
        named = dict(zip((arg.label for arg in a["kernel"].adj.args), [*a["inputs"], *a["outputs"]]))
        return rec.stage_call(rule, record_and_run, (), named)
    return _ORIGINAL["launch"](*args, **kwargs)


def _hooked_copy(dest, src, dest_offset=0, src_offset=0, count=0, stream=None):
    rec = _recorder()
    if rec is not None:
        rec.copy(dest, src, dest_offset, src_offset, count)
        with rec.suspended():
            return _ORIGINAL["copy"](dest, src, dest_offset, src_offset, count, stream)
    return _ORIGINAL["copy"](dest, src, dest_offset, src_offset, count, stream)


def _hooked_clone(src, *args, **kwargs):
    rec = _recorder()
    if rec is None:
        return _ORIGINAL["clone"](src, *args, **kwargs)
    with rec.suspended():
        result = _ORIGINAL["clone"](src, *args, **kwargs)
    rec.set(result, src)
    return result


def _hooked_empty(*args, **kwargs):
    """``wp.empty`` (and so ``wp.zeros``, ``wp.full``, ``wp.empty_like``, ...) inside a traced call, zeroed.

    An uninitialised array may hold anything, so zeros are among its legal contents; the point is that the
    replay can then rebuild it. Its value when first touched is a constant of the program, and a constant an
    in-place launch writes is copied out of the program's literals on every call (mujoco_warp allocates its
    solver's and collision's scratch inside ``step``: XLA copied those buffers before the step's in-place
    launches, every step of a rollout). A written constant that is all zero bytes replays as ``jnp.zeros`` instead
    (``WarpProgram._zero``), which XLA writes without reading anything. The replay relies on the bytes seen, not
    on this hook: an array written by any means before its first recorded use keeps those values as its constant."""
    arr = _ORIGINAL["empty"](*args, **kwargs)
    if _ACTIVE and arr.ptr and arr.size:
        _ORIGINAL["zero_"](arr)
    return arr


def _hooked_zero(self):
    rec = _recorder()
    if rec is not None:
        rec.fill(self, 0)
        with rec.suspended():
            return _ORIGINAL["zero_"](self)
    return _ORIGINAL["zero_"](self)


def _hooked_fill(self, value):
    rec = _recorder()
    if rec is not None:
        rec.fill(self, value)
        with rec.suspended():
            return _ORIGINAL["fill_"](self, value)
    return _ORIGINAL["fill_"](self, value)


def _hooked_assign(self, src):
    rec = _recorder()
    if rec is not None:
        if isinstance(src, wp.array):
            rec.copy(self, src, 0, 0, 0)
        else:  # host data: a constant of the program
            rec.touch(self, "assigned array")
            with rec.suspended():
                _ORIGINAL["assign"](self, src)
                const = rec.arrays[rec.register(self, "assigned array")]
                rec.ops.append(_Fill(const.key, self.numpy().copy()))
            return None
        with rec.suspended():
            return _ORIGINAL["assign"](self, src)
    return _ORIGINAL["assign"](self, src)


def _hooked_host_read(name):
    def read(self, *args, **kwargs):
        if _recorder() is not None:
            raise RuntimeError(HOST_READ_MESSAGE.format(what=f"array.{name}() of a {self.dtype.__name__} array of shape {self.shape}"))
        return _ORIGINAL[name](self, *args, **kwargs)

    return read


def _refused_targets():
    """(owner, attribute, message) of every Warp entry point the replay cannot reproduce."""
    from warp._src import context

    targets = [(wp.HashGrid, "build", HOST_REBUILD_MESSAGE), (wp.Mesh, "refit", HOST_REBUILD_MESSAGE),
               (wp.Bvh, "refit", HOST_REBUILD_MESSAGE), (wp.Bvh, "rebuild", HOST_REBUILD_MESSAGE),
               (wp.Mesh, "rebuild", HOST_REBUILD_MESSAGE)]
    # Warp's own modules call these by their module-level names in warp._src.context: patch both
    for owner in (wp, context):
        targets += [(owner, "capture_launch", UNSUPPORTED_OP_MESSAGE), (owner, "capture_begin", UNSUPPORTED_OP_MESSAGE),
                    (owner, "capture_if", CONTROL_FLOW_MESSAGE)]
    targets.append((wp.Launch, "launch", UNSUPPORTED_OP_MESSAGE))  # a recorded Launch object, made before the trace
    for name in ("array_scan", "radix_sort_pairs", "segmented_sort_pairs", "runlength_encode", "array_sum", "array_inner"):
        targets.append((wp.utils, name, UNSUPPORTED_OP_MESSAGE))
    return [(o, a, m) for o, a, m in targets if hasattr(o, a)]


def _is_scalar_argument(value) -> bool:
    """A kernel argument a per-launch rule sees by value: what ``_Recorder.launch`` records as
    ``("scalar", _plain_scalar(value))`` (not a ``wp.struct``), less arrays and None."""
    return value is not None and not isinstance(value, wp.array) and not hasattr(value, "_cls")


def _hooked_capture_while(condition, while_body, stream=None, **kwargs):
    rec = _recorder()
    if rec is None:
        return _ORIGINAL["capture_while"](condition, while_body, stream=stream, **kwargs)
    if not callable(while_body) or stream is not None:
        raise TypeError(CONTROL_FLOW_MESSAGE.format(what="wp.capture_while with a Graph body or a stream"))
    rec.capture_while(condition, while_body, kwargs)


def _stage_hook(rule: StageRule, original):
    @functools.wraps(original)
    def call(*args, **kwargs):
        rec = _recorder()
        return original(*args, **kwargs) if rec is None else rec.stage_call(rule, original, args, kwargs)

    return call


@contextlib.contextmanager
def _hooks(rec: _Recorder, rules: tuple[StageRule, ...] = ()):
    from warp._src import context

    _install_hooks()
    patches = [
        # context.launch: wp.launch_tiled (and any Warp function launching by that name) goes through it
        (wp, "launch", _hooked_launch), (context, "launch", _hooked_launch),
        (wp, "capture_while", _hooked_capture_while), (context, "capture_while", _hooked_capture_while),
        (wp, "copy", _hooked_copy), (wp, "clone", _hooked_clone),
        # context.empty: wp.zeros, wp.full, wp.empty_like, ... allocate through it by that name
        (wp, "empty", _hooked_empty), (context, "empty", _hooked_empty),
        (wp.array, "zero_", _hooked_zero), (wp.array, "fill_", _hooked_fill), (wp.array, "assign", _hooked_assign),
        (wp.array, "numpy", _hooked_host_read("numpy")), (wp.array, "list", _hooked_host_read("list")),
    ]
    for owner, attr, message in _refused_targets():
        name = f"{getattr(owner, '__name__', owner)}.{attr}"
        _ORIGINAL.setdefault(name, getattr(owner, attr))
        patches.append((owner, attr, _refusal_named(name, message)))
    rec.launch_rules = [(_stage_rules.launch_matcher(rule), rule) for rule in rules if rule.per_launch]
    for rule in (rule for rule in rules if not rule.per_launch):
        if not callable(getattr(rule.owner, rule.name, None)):
            raise TypeError(f"warpnn.trace: StageRule names {rule.key}, which is not a function of {rule.owner!r}.")
        hook = _stage_hook(rule, getattr(rule.owner, rule.name))
        # (on a class, a static or class method's hook calls it as looked up: bound already)
        static = isinstance(inspect.getattr_static(rule.owner, rule.name), (staticmethod, classmethod))
        patches.append((rule.owner, rule.name, staticmethod(hook) if static else hook))
    saved = [(o, a, inspect.getattr_static(o, a) if isinstance(o, type) else getattr(o, a)) for o, a, _ in patches]
    with _TRACE_LOCK:
        for owner, attr, fn in patches:
            setattr(owner, attr, fn)
        _ACTIVE.append(rec)
        try:
            yield
        finally:
            _ACTIVE.pop()
            for owner, attr, fn in saved:
                setattr(owner, attr, fn)


def _refusal_named(name, message):
    rebuild = message is HOST_REBUILD_MESSAGE
    shown = name.replace("warp._src.context.", "wp.").replace("warp.", "wp.")

    def refuse(*args, **kwargs):
        rec = _recorder()
        if rec is not None and not (rebuild and rec.frozen_host_ops):
            raise RuntimeError(message.format(what=shown))
        if rec is not None:
            with rec.suspended():
                return _ORIGINAL[name](*args, **kwargs)
        return _ORIGINAL[name](*args, **kwargs)

    return refuse


# --------------------------------------------------------------------------------------------------
# Python state the traced function closes over


_PLAIN_VALUES = (bool, int, float, complex, str, bytes, type(None), np.generic)


def _state_roots(fn) -> dict[str, Any]:
    """The objects ``fn`` reaches without arguments, by name: its closure, defaults, bound ``self``, partial args."""
    roots: dict[str, Any] = {}
    while True:
        if isinstance(fn, functools.partial):
            roots.update({f"partial arg {k}": v for k, v in enumerate(fn.args)})
            roots.update(fn.keywords)
            fn = fn.func
        elif inspect.ismethod(fn):
            roots["self"] = fn.__self__
            fn = fn.__func__
        else:
            break
    code = getattr(fn, "__code__", None)
    for name, cell in zip(code.co_freevars if code else (), getattr(fn, "__closure__", None) or ()):
        with contextlib.suppress(ValueError):  # an empty cell
            roots[name] = cell.cell_contents
    for k, value in enumerate(getattr(fn, "__defaults__", None) or ()):
        roots[f"default {k}"] = value
    return roots


def _python_state(fn, depth: int = 3, limit: int = 20000) -> dict[tuple[int, str], tuple[Any, str, Any]]:
    """The attributes of the objects ``fn`` closes over, ``depth`` levels deep: ``{(id(owner), attribute): (owner,
    path, value)}``, plain values (numbers, strings, None) and, for any other value, the object itself (compared by
    identity: a step that swaps ``self.state_0, self.state_1`` rebinds them). Warp's own objects are not looked
    into (the recorder watches arrays' data), and neither are modules, classes and functions."""
    found: dict[tuple[int, str], tuple[Any, str, Any]] = {}
    seen: set[int] = set()
    frontier = list(_state_roots(fn).items())
    for _ in range(depth):
        following = []
        for path, obj in frontier:
            if id(obj) in seen or len(seen) > limit or isinstance(obj, _PLAIN_VALUES):
                continue
            seen.add(id(obj))
            if isinstance(obj, (list, tuple)):
                following += [(f"{path}[{k}]", v) for k, v in enumerate(obj)]
                continue
            if isinstance(obj, dict):
                following += [(f"{path}[{k!r}]", v) for k, v in obj.items() if isinstance(k, _PLAIN_VALUES)]
                continue
            attrs = getattr(obj, "__dict__", None)
            if (not isinstance(attrs, dict) or inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(obj)
                    or _library_object(obj)):
                continue
            for name, value in list(attrs.items()):
                found[(id(obj), name)] = (obj, f"{path}.{name}", value)
                if not isinstance(value, _PLAIN_VALUES):
                    following.append((f"{path}.{name}", value))
        frontier = following
    return found


def _library_object(obj) -> bool:
    """Whether ``obj`` is Warp's, JAX's or NumPy's own (arrays, meshes, tapes: their attributes are the library's
    bookkeeping), not user code; Warp's examples are user code that ships with Warp."""
    module = type(obj).__module__ or ""
    return module.split(".")[0] in ("warp", "jax", "jaxlib", "numpy") and not module.startswith("warp.examples")


def _restore_python_state(before, after_fn, accepted: tuple[str, ...]) -> list[str]:
    """Put back every attribute ``fn`` changed (a plain value, or an object rebound); return the changes not
    ``accepted``, described. An attribute that was None and now holds an object (a buffer allocated on first use)
    is kept: the recorded launches already use it, and a later call finds it there as it would have."""
    changes = []
    after = _python_state(after_fn)
    for key, (obj, path, value) in before.items():
        now = after.get(key)
        if now is None or now[2] is value:
            continue
        plain = isinstance(value, _PLAIN_VALUES) and isinstance(now[2], _PLAIN_VALUES)
        if (plain and now[2] == value and type(now[2]) is type(value)) or (value is None and not plain):
            continue
        setattr(obj, key[1], value)
        if not any(path == name or path.endswith("." + name) for name in accepted):
            changes.append(f"{path} {_described(value)} -> {_described(now[2])}")
    return changes


def _described(value) -> str:
    """A value as a Python-state change names it: plain values as they are, an object by its type and identity."""
    if isinstance(value, _PLAIN_VALUES):
        return repr(value)
    shape = f" of shape {value.shape}" if isinstance(value, wp.array) else ""
    return f"<{type(value).__name__}{shape} at {id(value):#x}>"


def trace(
    fn: Callable[[], Any],
    inputs: Mapping[str, wp.array],
    outputs: Mapping[str, wp.array],
    *,
    frozen_host_ops: bool = False,
    python_state: tuple[str, ...] | list[str] = (),
    rules: tuple[StageRule, ...] | list[StageRule] = (),
) -> WarpProgram:
    """Record the Warp operations of ``fn()`` once and return them as a pure JAX function.

    Example::

        solver = newton.solvers.SolverSemiImplicit(model)
        program = warpnn.trace(
            lambda: solver.step(s0, s1, control, contacts, dt),
            inputs={"q": s0.particle_q, "qd": s0.particle_qd, "f": s0.particle_f, "ke": model.spring_stiffness},
            outputs={"q": s1.particle_q, "qd": s1.particle_qd},
        )
        out = program({"q": q, "qd": qd, "f": f, "ke": ke})      # jit / grad / vmap / lax.scan it

    ``fn`` runs once, for real, on the arrays' device; afterwards every array it touched is restored to its
    contents before the call, so tracing changes no data the caller holds.

    Each launch becomes one ``warpnn.jax_kernel`` call whose results are the arrays the kernel writes. An array
    every thread provably stores whole is a pure output (no operand, nothing copied); any other written array
    is in-out, updated from its previous value as Warp updates it (accumulations, conditional stores). Where a
    pure output precedes another result in the kernel's signature, the replay launches the kernel with its
    parameters reordered (same body), since ``jax_kernel`` takes pure outputs at the end. ``describe()`` lists
    each launch's results (``name =``: pure output, ``name updated``: in-out).

    Args:
        fn: a function of no arguments that launches Warp kernels (close over the objects it needs).
        inputs: the arrays whose values the program takes as JAX arguments, by name. Every other array
            ``fn`` reads is a constant: its value when it was first touched during the trace.
        outputs: the arrays whose final values the program returns, by name.
        frozen_host_ops: accept host-side rebuilds (``HashGrid.build``, ``Mesh.refit``, ...) inside ``fn``;
            the replay then uses the structure built at trace time.
        python_state: attributes (``"_step"`` or a path such as ``"solver._step"``) of the objects ``fn`` closes
            over that ``fn`` may change without changing its launches or what ``inputs`` and ``outputs``
            name. Any other change of an attribute up to three objects deep is refused: a plain value (a number,
            a string, None) the replay would freeze, or an object rebound (a step that swaps ``self.state_0`` and
            ``self.state_1`` leaves the arrays named in ``outputs`` holding an intermediate). Either way tracing
            puts the values back; an attribute that was None and now holds an object (a buffer allocated on
            first use) is kept.

    Returns:
        A :class:`WarpProgram`.
    """
    rec = _Recorder(inputs, frozen_host_ops)
    output_arrays = {}
    for name, arr in outputs.items():
        if not isinstance(arr, wp.array):
            raise TypeError(f"warpnn.trace: output '{name}' must be a wp.array, got {type(arr).__name__}.")
        output_arrays[name] = arr
    state = _python_state(fn)
    ran = False
    try:
        with _hooks(rec, tuple(rules)):
            fn()
        output_keys = {name: rec.touch(arr, name) for name, arr in output_arrays.items()}
        ran = True
    finally:
        wp.synchronize()
        rec.restore()
        changes = _restore_python_state(state, fn, tuple(python_state))
    if ran and changes:  # (after a failure, the failure is the news; the state is put back either way)
        raise RuntimeError(PYTHON_STATE_MESSAGE.format(changes=", ".join(changes)))
    rec.settle_proofs()
    rec.settle_stages()
    program = WarpProgram(rec.ops, rec.arrays, rec.snapshots, rec.input_keys, output_keys, rec.views, rec.stages,
                          rec.loops)
    program._platform = rec.platform
    return program
