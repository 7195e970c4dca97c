"""Stage rules: the launches of one Python function, differentiated as a whole by a JAX function.

Some stages of a Warp program have no per-kernel adjoint that could be right: an iterative solver (its line search,
convergence tests and in-place updates), or a factorization whose kernel reads what it just wrote. Their result is
still a differentiable function of their inputs, given by conditions the library's authors know: a solve
``x = M^-1 y``, the optimality conditions of a convex problem at its solution. A :class:`StageRule` names such a
function and a JAX ``rule`` for those conditions: the traced program replays the stage's launches as Warp ran them
(the forward is unchanged), and its reverse mode is the VJP of ``rule`` (``jax.custom_vjp`` around the launches).
That is how JAX users differentiate through solvers (``jax.lax.custom_root``, MJX's constraint solver), put where the
launches are.

What keeps a rule honest (``warpnn.trace`` checks each, and refuses reverse mode through the stage with the reason):

* the rule must reproduce the stage: when the function is traced, the rule is evaluated on the arrays' values before
  the call and compared with the values the launches left (``rtol``);
* every floating-point array the launches read that was written earlier in the program or is an input must be taken
  by the rule (``reads``) or declared as not changing the derivative (``ignores``: a warm start, a buffer the stage
  overwrites) -- otherwise its gradient would be lost;
* every floating-point array the launches write that the rule does not compute gets no gradient: a cotangent that
  reaches it makes the stage's input cotangents NaN (never a silent zero), as does a gradient with respect to a
  constant of the program the stage reads (constants passed to ``WarpProgram`` and differentiated).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _no_arrays(*args, **kwargs) -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class StageRule:
    """Differentiate the launches of ``owner.name(...)`` inside :func:`warpnn.trace` by the JAX function ``rule``.

    ``reads``, ``writes``, ``context`` and ``ignores`` are called with the function's arguments each time it runs
    inside the trace, and return the ``wp.array`` s they name, by name::

        warpnn.StageRule(
            mujoco_warp._src.smooth, "factor_solve_i",               # smooth.factor_solve_i(m, d, M, L, D, x, y)
            reads=lambda m, d, M, L, D, x, y: {"M": M, "y": y},
            writes=lambda m, d, M, L, D, x, y: {"x": x},
            ignores=lambda m, d, M, L, D, x, y: {"L": L, "D": D, "x": x},   # overwritten
            rule=lambda before, after: {"x": jnp.linalg.solve(dense(before["M"]), before["y"])},
        )

    Args:
        owner, name: where the function is looked up when it is called (a module or a class, and the attribute);
            the trace replaces the attribute while it runs. A call inside another rule's stage is part of that stage.
        rule: ``rule(before, after) -> {name: value}`` for every name in ``writes``. ``before``: the ``reads``
            arrays' values before the call (what the VJP differentiates); ``after``: the values the launches left
            in ``writes`` and ``context`` (not differentiated: a converged solution, an active set, a count).
        reads: the arrays whose values before the call the rule differentiates.
        writes: the arrays whose values after the call the rule returns; their cotangents reach ``reads``.
        context: arrays the rule looks at, after the call, without differentiating them.
        ignores: arrays the launches read whose values do not change the derivative of ``writes`` (their
            cotangent is zero): warm starts of a converged solve, buffers the stage overwrites before using.
        rtol: how closely the rule must reproduce the launches when traced, relative to each array's largest
            magnitude (at least 1).
        per_launch: ``owner.name`` is a Warp kernel, or a function that makes kernels (a kernel factory such as
            mujoco_warp's ``@cache_kernel`` functions), and each launch of such a kernel is one stage: for a
            launch made inside a larger function (mujoco_warp's contact Jacobian inside ``make_constraint``).
            ``reads``, ``writes``, ``context`` and ``ignores`` are then called with the launch's arguments as
            keywords, by the kernel's parameter names (``reads=lambda cdof_in, qvel_in, **_: {...}``), and
            ``rule``'s ``after`` also holds the launch's scalar arguments by name.

    The rule runs (when checked and in reverse mode) with ``jax.default_matmul_precision("highest")``: it stands for
    launches that compute in full float32, and XLA's default for a float32 product on a recent NVIDIA GPU is TF32
    (a 10-bit mantissa), which would put ~1e-3 relative error into every gradient through the rule.

    The gradient is the rule's, exactly: warpnn checks its values, not its derivative. A rule that returns ``after``
    values unchanged has zero derivative; one that leaves out a dependence (a parameter of the solve) drops it.
    ``reads`` and ``ignores`` are the rule author's statement of what the result depends on.
    """

    owner: Any
    name: str
    rule: Callable[[Mapping[str, jax.Array], Mapping[str, jax.Array]], Mapping[str, jax.Array]]
    reads: Callable[..., Mapping[str, Any]]
    writes: Callable[..., Mapping[str, Any]]
    context: Callable[..., Mapping[str, Any]] = _no_arrays
    ignores: Callable[..., Mapping[str, Any]] = _no_arrays
    rtol: float = 1e-3
    per_launch: bool = False

    @property
    def key(self) -> str:
        """How refusals and ``describe()`` name the stage: ``module.function``."""
        return f"{getattr(self.owner, '__name__', type(self.owner).__name__)}.{self.name}"


def launch_matcher(rule: StageRule) -> Callable[[Any], bool]:
    """For a ``per_launch`` rule: whether a launched ``wp.Kernel`` is ``owner.name`` or was made by it."""
    import inspect

    import warp as wp

    target = getattr(rule.owner, rule.name, None)
    if isinstance(target, wp.Kernel):
        return lambda kernel: kernel.func is target.func
    if not callable(target):
        raise TypeError(f"warpnn.trace: StageRule names {rule.key}, which is neither a Warp kernel nor a function "
                        f"that makes kernels (per_launch=True).")
    factory = inspect.unwrap(target)
    module, inner = factory.__module__, f"{factory.__qualname__}.<locals>."
    return lambda kernel: kernel.func.__module__ == module and kernel.func.__qualname__.startswith(inner)


def _full_float32():
    """The matmul precision rules run at: Warp's own float32 arithmetic, not XLA's GPU default (TF32 tensor cores)."""
    return jax.default_matmul_precision("highest")


def _rule_on_arrays(rule, scalars: tuple):
    """``rule`` as a function of the arrays alone: a per-launch rule's scalar arguments are constants in it, as in
    the replay's backward (``stage_function``)."""
    return lambda before, after: dict(rule(before, {**after, **{n: jnp.asarray(v) for n, v in scalars}}))


@functools.lru_cache(maxsize=64)
def _jitted_rule(rule, scalars: tuple):
    """One compiled check per rule and scalar arguments: a model traced again in a process reuses it."""
    return jax.jit(_rule_on_arrays(rule, scalars))


def check(rule: StageRule, before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray],
          writes: list[str]) -> str | None:
    """Why ``rule`` does not reproduce what the stage's launches left in ``writes`` at trace time, or None."""
    # The rule runs as one jitted program, as the replay's backward runs it (arrays traced, a per-launch rule's
    # scalar arguments constants): evaluated op by op, each of its operations was an XLA compile of its own (5 s of
    # a MuJoCo arm's 12 s first trace on a CPU). A rule that needs concrete values runs eagerly.
    arrays = {n: v for n, v in after.items() if isinstance(v, np.ndarray)}
    scalars = tuple(sorted((n, v) for n, v in after.items() if n not in arrays))
    try:
        jitted = _jitted_rule(rule.rule, scalars)
    except TypeError:  # (a scalar argument that cannot be hashed: compiled for this call only)
        jitted = jax.jit(_rule_on_arrays(rule.rule, scalars))
    try:
        with jax.ensure_compile_time_eval(), _full_float32():
            try:
                computed = jitted(before, arrays)
            except (jax.errors.JAXTypeError, jax.errors.NonConcreteBooleanIndexError):  # (it reads a value in Python)
                computed = _rule_on_arrays(rule.rule, scalars)({n: jnp.asarray(v) for n, v in before.items()},
                                                               {n: jnp.asarray(v) for n, v in arrays.items()})
    except Exception as e:  # noqa: BLE001 - the rule's own refusal (NotImplementedError) or a bug: either way, no rule
        return f"its rule raised {type(e).__name__}: {e}"
    missing = sorted(n for n in writes if n not in computed)
    if missing:
        return f"its rule returned no value for {missing}"
    for name in writes:
        got, want = np.asarray(computed[name]), after[name]
        if got.shape != want.shape:
            return f"its rule returned shape {got.shape} for '{name}', the array has shape {want.shape}"
        # (equal entries agree, infinities included: a kernel's "no contact" is an infinite distance; an infinity
        # against a finite value, or a NaN, is an infinite or NaN error and refuses)
        differ = got != want
        scale = max(1.0, float(np.max(np.abs(want), where=np.isfinite(want), initial=0.0)))
        with np.errstate(invalid="ignore"):  # (inf - inf where both agree: masked out)
            error = float(np.max(np.abs(got.astype(np.float64) - want), where=differ, initial=0.0))
        if not error <= rule.rtol * scale:
            return (f"its rule does not reproduce the launches at trace time: '{name}' differs by {error:.3g} "
                    f"(largest magnitude {scale:.3g}, rtol {rule.rtol:g})")
    return None


def is_float(dtype) -> bool:
    return np.issubdtype(np.dtype(dtype), np.floating)


@dataclasses.dataclass(frozen=True)
class StageRecord:
    """One traced call of a :class:`StageRule`'s function: its launches are ``ops[start:end]`` of the program.

    Keys are the tracer's base array keys. ``outside``: every array the stage's operations read before writing it,
    the declared reads, and the arrays the rule sees that the operations leave alone (the primal arguments of the
    stage's ``custom_vjp``); ``written``: every array they write, and declared writes they leave alone (its
    results). ``zero_cotangent``: written floating-point arrays the rule does not compute; ``nan_cotangent``:
    constants of the program the stage reads and the rule does not take."""

    rule: StageRule
    start: int
    end: int
    reads: tuple[tuple[str, Any], ...]
    writes: tuple[tuple[str, Any], ...]
    context: tuple[tuple[str, Any], ...]
    ignored: frozenset = frozenset()
    outside: tuple[Any, ...] = ()
    written: tuple[Any, ...] = ()
    zero_cotangent: tuple[Any, ...] = ()
    nan_cotangent: tuple[Any, ...] = ()
    refusal: str | None = None
    names: tuple[tuple[Any, str], ...] = ()  # (key, parameter name) of a per-launch stage's arrays
    scalars: tuple[tuple[str, Any], ...] = ()  # a per-launch stage's scalar arguments, by parameter name


def settle(record: StageRecord, read_keys, written_keys, inputs, written_before, dtypes, labels) -> StageRecord:
    """``record`` with what its operations read and write and, where a floating-point array they read from the
    program (an input, or written before the stage) is neither taken nor ignored by the rule, its refusal."""
    declared = {k for _, k in record.reads}
    launched = set(written_keys)
    # arrays the rule sees that the launches leave alone keep their values from before the stage: a declared write
    # passes through (it is a result all the same, which the rule computes)
    untouched = [k for _, k in (*record.context, *record.writes) if k not in launched]
    outside = list(dict.fromkeys([*read_keys, *declared, *untouched]))
    written = [*written_keys, *dict.fromkeys(k for _, k in record.writes if k not in launched)]
    unruled = [k for k in outside if is_float(dtypes[k]) and k not in declared and k not in record.ignored]
    constants = tuple(k for k in unruled if k not in inputs and k not in written_before)
    lost = [k for k in unruled if k not in constants and k in read_keys]
    refusal = record.refusal
    if refusal is None and lost:
        refusal = (f"its launches read {sorted({labels[k] for k in lost})}, which the program computes or takes as "
                   "inputs, and which its rule neither reads nor ignores (their gradient would be lost). Fix: add "
                   "them to the rule's reads, or to its ignores where they do not change the derivative")
    computed = {k for _, k in record.writes}
    zero = tuple(k for k in written if is_float(dtypes[k]) and k not in computed)
    return dataclasses.replace(record, outside=tuple(outside), written=tuple(written), zero_cotangent=zero,
                               nan_cotangent=constants, refusal=refusal)


def stage_function(record: StageRecord, replay: Callable[[dict], dict], dtypes) -> Callable:
    """The stage as ``f(*values of record.outside) -> tuple(values of record.written)``: forward by ``replay`` (the
    launches, given and returning ``{key: value}``), reverse by the VJP of the rule."""
    position = {k: i for i, k in enumerate(record.outside)}

    def forward(*values):
        env = replay(dict(zip(record.outside, values)))
        return tuple(env[k] for k in record.written)

    f = jax.custom_vjp(forward)

    def fwd(*values):
        outs = forward(*values)
        return outs, (values, outs)

    def bwd(residuals, cotangents):
        if record.refusal is not None:
            raise TypeError(REFUSED_MESSAGE.format(key=record.rule.key, why=record.refusal))
        values, outs = residuals
        now = dict(zip(record.outside, values))
        now.update(zip(record.written, outs))
        after = {n: jax.lax.stop_gradient(now[k]) for n, k in (*record.writes, *record.context)}
        after.update((n, jnp.asarray(v)) for n, v in record.scalars)
        before = {n: values[position[k]] for n, k in record.reads}
        ct = dict(zip(record.written, cotangents))
        with _full_float32():
            _, vjp = jax.vjp(lambda b: dict(record.rule.rule(b, after)), before)
            (ct_before,) = vjp({n: ct[k] for n, k in record.writes})
        # a cotangent the rule cannot carry (on a write it does not compute) poisons the result instead of vanishing
        lost = [jnp.any(ct[k] != 0) for k in record.zero_cotangent]
        poison = jnp.where(jnp.any(jnp.stack(lost)), jnp.nan, 0.0) if lost else None
        result: list[Any] = [None] * len(values)
        for n, k in record.reads:
            i = position[k]
            result[i] = ct_before[n] if result[i] is None else result[i] + ct_before[n]
        for k in record.nan_cotangent:
            result[position[k]] = jnp.full(np.shape(values[position[k]]), jnp.nan, dtypes[k])
        for i, k in enumerate(record.outside):
            if is_float(dtypes[k]):  # (integer arrays get no cotangent: None)
                r = jnp.zeros(np.shape(values[i]), dtypes[k]) if result[i] is None else result[i]
                result[i] = r if poison is None else r + poison.astype(r.dtype)
        return tuple(result)

    f.defvjp(fwd, bwd)
    return f


REFUSED_MESSAGE = ("warpnn: reverse mode through the stage '{key}' (a StageRule) is refused: {why}. Forward replays "
                   "are unaffected.")
