"""MuJoCo Warp inside JAX: ``mujoco_warp.step`` as a pure JAX step ``step(state, params) -> state``.

`MuJoCo Warp <https://github.com/google-deepmind/mujoco_warp>`_ (``pip install "warpnn[mujoco]"``) steps with
Python that launches Warp kernels on a ``mujoco_warp.Data``. :class:`MujocoStep` records one
``mujoco_warp.step(m, d)`` with :func:`warpnn.trace` and replays it as JAX operations: a rollout is a
``lax.scan`` (:func:`rollout`), ``jax.vmap`` batches initial states, and XLA compiles the whole step with no
Python per step. ``mujoco_warp`` runs unmodified: the constraint solver's ``wp.capture_while`` (iterate while some
world has not converged) is replayed as a ``lax.while_loop`` over one recorded iteration, so a step runs as many
solver iterations as it needs, as mujoco_warp's own CUDA graph does.

The pytrees are dicts of JAX arrays with mujoco_warp's shapes (``qpos``: ``(nworld, nq)``, ``time``:
``(nworld,)``; ``nworld=1`` unless given):

* ``state``: ``qpos``, ``qvel``, ``act``, ``ctrl``, ``time`` (those the model has), plus every ``Data`` array the
  step writes and reads back the next step (warm start ``qacc_warmstart``, and arrays mujoco_warp updates in
  place rather than provably overwriting: ``qacc``, ``xpos``, the constraint counters, ...), found by the tracer
  (``WarpProgram.frozen_state``), never by a hand list. Nested arrays are named ``contact.<field>`` /
  ``efc.<field>``. ``ctrl`` (and any other input the step only reads, such as ``qfrc_applied``) comes back unchanged.
* ``params``: ``Model`` array fields taken per call (``body_mass``, ``dof_damping``, ``actuator_gainprm``,
  ``geom_friction``, ...). They enter the kernels that read them; quantities ``put_model`` derives from them on
  the host (``body_invweight0``, ``actuator_acc0``, ...) keep their values from the model given.

What is checked (``tests/test_models_mujoco.py``): forward under ``jit`` / ``lax.scan`` / ``vmap`` against
``mujoco_warp.step`` run directly (bit-equal on an arm and a cart-pole hitting a joint limit) and against
``mujoco.mj_step`` (<= 3.5e-6), and a free box landing on a plane (contacts and the constraint solver); reverse mode
against central differences of ``mj_step``: through 1, 10 and 100 steps of the arm and of a box sliding on a plane
(<= 2e-6), through 1 and 10 steps of a branching tree with springs (<= 7.6e-5) and of a capsule pile, through a
step of mujoco_warp's humanoid (<= 4e-5), and through the cart-pole's active limit (5e-5). Stages no per-kernel
adjoint gets right are differentiated by rules (:func:`_stage_rules`, ``warpnn.StageRule``): the inertia solve, the
constraint solver (its optimality conditions at the solution), the primitive narrowphase and the contact Jacobian
(recomputed in JAX), tree walks over branches that share bodies, joints' and tendons' springs and dampers (right
where mujoco_warp skips a zero coefficient), the position sensors (:func:`_sensor_pos_rule`),
the kinetic energy, the position update (its quaternion integration, right at zero angular velocity), the velocity
derivative ``implicitfast`` solves with (:func:`_velocity_derivative_rule`), the ``implicit`` integrator's Coriolis
derivative and LU solve (:func:`_implicit_rules`), spatial tendons through sites (:func:`_tendon_site_rules`); the
other kernels through their adjoints (those mujoco_warp builds with ``enable_backward=False`` rebuilt), with tree walks
down a chain, in-place updates and loops bounded by the model proven when the step is traced. Refused today, with
the reason (``reverse_refusals()``): collision pairs other than a plane's with spheres, capsules, ellipsoids,
cylinders and boxes, a sphere's with spheres, capsules, cylinders and boxes, a capsule's with capsules and
boxes, two boxes (with ``nativeccd`` disabled: else mujoco_warp collides them by GJK/EPA), a mesh on a plane (other
mesh and convex pairs are refused), a sparse constraint Jacobian, spatial tendons with armature.
Elliptic friction cones differentiate (the contact rows by a rule, the solver's rule with the cone's force), and so
do the Euler, RK4 and ``implicitfast`` integrators and the Newton and CG solvers. See ``docs/mujoco.md``.

Example::

    step = MujocoStep(ARM_XML)                                  # an MJCF string or path, or a mujoco.MjModel
    state = step.initial_state()
    ctrls = {"ctrl": jnp.zeros((100, 1, step.mjm.nu), jnp.float32)}
    final, trajectory = jax.jit(lambda s, c: rollout(step, s, c))(state, ctrls)
"""

from __future__ import annotations

import copy
import dataclasses
import operator
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import warp as wp

import warpnn

from ._carry import trace_carrying
from ._linear_algebra import (cholesky, cholesky_reference, cholesky_solve, cholesky_solve_reference, lu_reference,
                              lu_solve_reference)

__all__ = ["MujocoStep", "data_arrays", "equinox_module", "nnx_module", "rollout"]

# (MuJoCo's inputs beside ctrl: forces applied in joint space and to bodies, per step like ctrl, and differentiable)
STATE_FIELDS = ("qpos", "qvel", "act", "ctrl", "time", "qfrc_applied", "xfrc_applied")
NESTED = ("contact", "efc")
# Data fields that are dataclasses of arrays


def data_arrays(obj) -> dict[str, wp.array]:
    """The non-empty ``wp.array`` fields of a ``mujoco_warp`` Data (or Model), nested ones as ``contact.dist``."""
    found = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if isinstance(value, wp.array):
            if value.size:
                found[field.name] = value
        elif field.name in NESTED and dataclasses.is_dataclass(value):
            found.update({f"{field.name}.{k}": v for k, v in data_arrays(value).items()})
    return found


def _csr_entries(rownnz, rowadr, colind):
    """A CSR layout's stored entries as index arrays (``rownnz``, ``rowadr``, ``colind`` wp arrays): each entry's
    place in the data, its row and its column, row by row."""
    import numpy as np

    rownnz, rowadr, colind = (np.asarray(a.numpy()) for a in (rownnz, rowadr, colind))
    entries = np.concatenate([np.arange(a, a + n) for a, n in zip(rowadr, rownnz)] or [[]]).astype(np.int32)
    return entries, np.repeat(np.arange(len(rownnz)), rownnz).astype(np.int32), colind[entries].astype(np.int32)


def _inertia_entries(m):
    """``M``'s CSR layout (the lower triangle, ``(nworld, nC)``): each stored entry's place in a row of ``M`` and
    its row and column in the matrix."""
    return _csr_entries(m.M_rownnz, m.M_rowadr, m.M_colind)


def _inertia_to_dense(m) -> Callable[[jax.Array], jax.Array]:
    """``M`` in mujoco_warp's CSR layout (the lower triangle, ``(nworld, nC)``) -> dense ``(nworld, nv, nv)``."""
    import numpy as np

    where, rows, cols = _inertia_entries(m)
    # dense[w, i, j] = M[w, k] for the CSR entry k of (i, j) or (j, i), else 0: one gather, where building the
    # matrix by scatters costs more on a GPU. Its reverse gathers too (M's entry k has the cotangents of (i, j) and
    # (j, i)): as the gather's transpose, XLA scatter-adds every dense entry, atomics on a GPU, and with the zeros
    # read from one appended element all of theirs queue on that one.
    entry = np.full((m.nv, m.nv), -1, np.int32)
    entry[rows, cols] = entry[cols, rows] = where
    nonzero = entry >= 0
    index = np.where(nonzero, entry, 0)
    first = np.zeros(where.max(initial=-1) + 1, np.int32)  # (each CSR entry's place in the dense matrix, mirrored)
    second = first.copy()
    first[where], second[where] = rows * m.nv + cols, cols * m.nv + rows
    mirrored = first != second

    @jax.custom_vjp
    def dense(M):
        return jnp.where(nonzero, M[:, index], 0.0)

    def dense_fwd(M):
        return dense(M), jnp.zeros((0, M.shape[1]), M.dtype)  # (M's shape, for its cotangent)

    def dense_bwd(shape_of_M, ct):
        ct = ct.reshape(ct.shape[0], -1)
        ct_M = ct[:, first] + jnp.where(mirrored, ct[:, second], 0.0)
        return (jnp.pad(ct_M, ((0, 0), (0, shape_of_M.shape[1] - first.size))),)

    dense.defvjp(dense_fwd, dense_bwd)
    return dense


def _stage_rules(m) -> list:
    """How reverse mode crosses the two stages of a step no per-kernel adjoint gets right (``warpnn.StageRule``).

    * ``smooth.factor_solve_i(m, d, M, L, D, x, y)``: factors the inertia-like matrix and solves ``x = M^-1 y``
      (``qacc_smooth``, the implicit damping's ``qacc``); its kernels write ``x`` and read it back. Rule: the solve.
    * ``solver.solve(m, d)``: the constraint solver (which runs even without constraints). Its converged ``qacc``
      minimises ``0.5 (a - a_s)' M (a - a_s) + s(J a - aref)``; at the solution ``F(a) = M (a - a_s) - J' f(J a -
      aref) = 0`` with the constraint forces ``f`` (``-D (J a - aref)`` on the rows the solver left QUADRATIC,
      ``+-frictionloss`` on LINEARNEG / LINEARPOS, 0 on SATISFIED). The rule is one Newton step on ``F`` from the
      solution with the active set held (implicit differentiation: ``da = -H^-1 dF``, ``H = M + J' D J``), as MJX's
      JAX backend differentiates its solver. Elliptic cones add the force of a contact in the cone's middle
      zone (``CONE``: :func:`_elliptic_cone_force`), which couples the contact's rows; ``H`` is then ``M`` minus
      ``J'`` times the force's derivative (forward mode, a column per dof). Covered: a dense Jacobian, pyramidal
      and elliptic cones, no noslip; otherwise the rule refuses and reverse mode through the solver is refused
      with it.
    """
    from mujoco_warp._src import forward, smooth, solver, types

    if hasattr(forward, "_wrap_period"):  # (mujoco_warp 4.0's; under another name the guard's NaN stays: safe)
        warpnn.keep_side_taken(
            forward._wrap_period, "it classifies an actuator as a servo (gainprm[0] == -biasprm[1], true for every "
            "position actuator) and by which gear components are 0; the period it returns changes the force only "
            "where the servo's error wraps around, where the force has no derivative")
    dense = _inertia_to_dense(m)
    nv = m.nv
    quadratic, negative, positive, cone_state = (int(types.ConstraintState.QUADRATIC),
                                                 int(types.ConstraintState.LINEARNEG),
                                                 int(types.ConstraintState.LINEARPOS), int(types.ConstraintState.CONE))

    def solve_rule(before, after):
        y = before["y"]
        x = _spd_solve(dense(before["M"]), y[:, :nv])
        return {"x": after["x"].at[:, :nv].set(x) if after["x"].shape[1] > nv else x}

    elliptic = m.opt.cone == types.ConeType.ELLIPTIC
    unsupported = ("a sparse constraint Jacobian (mujoco_warp's default above 32 dofs; MujocoStep(..., "
                   "sparse_jacobian=False) traces a dense one, the same physics)" if m.is_sparse else
                   "noslip iterations" if m.opt.noslip_iterations > 0 else None)

    def constraint_rule(before, after):
        if unsupported is not None:
            raise NotImplementedError(f"the constraint solver's implicit rule covers a dense Jacobian without "
                                      f"noslip; this model has {unsupported}")
        M = dense(before["M"])
        J = before["efc.J"][:, :, :nv]
        rows = jnp.arange(J.shape[1])[None, :] < after["nefc"][:, None]
        state = after["efc.state"]
        d = jnp.where(rows & (state == quadratic), before["efc.D"], 0.0)
        linear = jnp.where(rows & (state == negative), before["efc.frictionloss"], 0.0) \
            - jnp.where(rows & (state == positive), before["efc.frictionloss"], 0.0)
        cone = _elliptic_cone_force(before, after, rows & (state == cone_state)) \
            if elliptic and after["contact.dim"].shape[0] else None  # (no contact slots: no cone)

        def force(a):
            residual = _matvec(J, a) - before["efc.aref"]
            f = -d * residual + linear
            return f if cone is None else f + cone(residual)

        def residual(a):
            return _matvec(M, a - before["qacc_smooth"][:, :nv]) - _matvec_transposed(J, force(a))

        solution = after["qacc"][:, :nv]
        if cone is None:
            hessian = M + jnp.einsum("wrv,wr,wru->wvu", J, d, J)
        else:  # (the cone's force couples a contact's rows: -df/da, one column per dof, by forward mode)
            basis = jnp.broadcast_to(jnp.eye(nv, dtype=solution.dtype)[:, None], (nv, *solution.shape))
            columns = jax.vmap(lambda t: jax.jvp(force, (solution,), (t,))[1])(basis)  # (dof, world, row)
            hessian = M - jnp.einsum("wrv,uwr->wvu", J, columns)
        a = solution - _spd_solve(jax.lax.stop_gradient(hessian), residual(solution))
        f = force(a)
        return {"qacc": a, "qfrc_constraint": _matvec_transposed(J, f),
                "efc.force": jnp.where(rows, f, before["efc.force"]), "efc.Ma": _matvec(M, a)}

    factor_solve = warpnn.StageRule(
        smooth, "factor_solve_i", solve_rule,
        reads=lambda m, d, M, L, D, x, y: {"M": M, "y": y},
        writes=lambda m, d, M, L, D, x, y: {"x": x},
        ignores=lambda m, d, M, L, D, x, y: {"L": L, "D": D, "x": x},  # overwritten
    )

    def cone_reads(m, d):  # (an elliptic cone's force reads the contact's friction; a pyramid's enters through J)
        return {"contact.friction": d.contact.friction, "opt.impratio_invsqrt": m.opt.impratio_invsqrt} \
            if elliptic else {}

    constraint_solve = warpnn.StageRule(
        solver, "solve", constraint_rule,
        reads=lambda m, d: {"M": d.M, "qacc_smooth": d.qacc_smooth, "efc.J": d.efc.J, "efc.D": d.efc.D,
                            "efc.aref": d.efc.aref, "efc.frictionloss": d.efc.frictionloss, "efc.force": d.efc.force,
                            **cone_reads(m, d)},
        writes=lambda m, d: {"qacc": d.qacc, "qfrc_constraint": d.qfrc_constraint, "efc.force": d.efc.force,
                             "efc.Ma": d.efc.Ma},
        context=lambda m, d: {"nefc": d.nefc, "efc.state": d.efc.state, **({
            "efc.id": d.efc.id, "contact.dim": d.contact.dim, "contact.efc_address": d.contact.efc_address}
            if elliptic else {})},
        # the warm start does not move a converged solution, nor does the CG solver's preconditioner (the
        # inertia's factor, qLD and qLDiagInv: it steers the iterations, not where they converge);
        # qfrc_smooth = M qacc_smooth is read through both; the rest is overwritten
        ignores=lambda m, d: {"qacc_warmstart": d.qacc_warmstart, "qLD": d.qLD, "qLDiagInv": d.qLDiagInv,
                              "qfrc_smooth": d.qfrc_smooth,
                              "qfrc_constraint": d.qfrc_constraint, "efc.Ma": d.efc.Ma, "qacc": d.qacc,
                              # (with elliptic cones the solver's Hessian skips contacts by their distance: a
                              # choice of the active set, which efc.state holds)
                              **({"contact.dist": d.contact.dist, "contact.includemargin": d.contact.includemargin}
                                 if elliptic else {"contact.friction": d.contact.friction})},
    )
    rules = [factor_solve, constraint_solve, _position_rule(m), _passive_rule(m), _applied_force_rule(m),
             _tendon_armature_rule(m), *_tendon_dot_rule(m), *_tendon_site_rules(m), *_tendon_geom_rule(m),
             *_tendon_path_rule(m), *_tendon_bias_rules(m), *_tendon_passive_rule(m), *_sensor_pos_rule(m),
             _kinetic_energy_rule(), *_transmission_rule(m), *_tree_rules(m), *_contact_rules(m),
             *([_elliptic_rows_rule(m)] if elliptic else []), *_velocity_derivative_rule(m), *_implicit_rules(m)]
    return _for_this_mujoco_warp(rules)


# The rules transcribe mujoco_warp's kernels and functions as this version writes them (the extra pins it).
TRANSCRIBED_MUJOCO_WARP = "4.0."


def _for_this_mujoco_warp(rules: list) -> list:
    """``rules``, or where the installed mujoco_warp is not the version they transcribe, the same stages refused:
    a rule checked against the launches at trace time can still differ from another version's kernel in its
    derivative (a branch, a contact's numbering), so reverse mode is refused, naming both versions; the forward
    replays the launches and is unaffected."""
    from importlib.metadata import version

    installed = version("mujoco-warp")
    if installed.startswith(TRANSCRIBED_MUJOCO_WARP):
        return rules

    def refused(before, after):
        raise NotImplementedError(f"warpnn_models.mujoco's rules transcribe mujoco_warp {TRANSCRIBED_MUJOCO_WARP}x; "
                                  f"{installed} is installed (pip install 'warpnn[mujoco]' pins the version they "
                                  f"cover)")

    return [dataclasses.replace(rule, rule=refused) for rule in rules]


def _elliptic_cone_force(before, after, on_cone):
    """The constraint force of the contact rows in an elliptic cone's middle zone (``efc.state`` CONE), as a
    function of the rows' residuals ``J a - aref``: as mujoco_warp's ``solver._eval_elliptic_middle`` (MuJoCo's
    ``mj_constraintUpdate``) computes it from the contact's normal row and the norm of its friction rows, each
    scaled by its friction coefficient: ``N = mu r_0``, ``T = |(f_j r_j)_j|``, ``f_0 = -dm (N - mu T) mu``,
    ``f_j = -f_0 / T  f_j^2 r_j``, ``dm = D_0 / (mu^2 (1 + mu^2))``, ``mu = friction_0 / sqrt(impratio)``. Rows
    in other states get 0 (their force is the quadratic or linear one)."""
    worlds, nrows = on_cone.shape
    contact = jnp.clip(after["efc.id"], 0, after["contact.dim"].shape[0] - 1)  # (world, row)
    address = after["contact.efc_address"][contact]  # (world, row, slot): each row's contact's rows
    dim = after["contact.dim"][contact]
    friction = before["contact.friction"][contact]  # (world, row, 5)
    ratio = before["opt.impratio_invsqrt"]
    mu = friction[..., 0] * _per_world(ratio, worlds)[:, None]
    slot = jnp.arange(address.shape[-1])
    tangent = (slot >= 1) & (slot[None, None] < dim[..., None]) & (address >= 0)  # (world, row, slot)
    scale = jnp.where(tangent, friction[..., jnp.clip(slot - 1, 0, friction.shape[-1] - 1)], 0.0)  # f_j
    world = jnp.arange(worlds)[:, None, None]
    at = jnp.clip(address, 0, nrows - 1)
    normal_row = at[..., 0]
    D0 = jnp.take_along_axis(before["efc.D"], normal_row, 1)
    dm = D0 / jnp.where(on_cone, mu * mu * (1.0 + mu * mu), 1.0)
    this_slot = jnp.arange(nrows)[None, :, None] == address  # (world, row, slot): the row's own slot

    def cone(residual):
        u = jnp.where(tangent, residual[world, at] * scale, 0.0)  # f_j r_j of each row's contact
        squared = jnp.sum(u * u, -1)
        T = jnp.sqrt(jnp.where(on_cone, squared, 1.0))  # (a middle-zone contact has T > 0)
        N = mu * jnp.take_along_axis(residual, normal_row, 1)
        normal_force = -dm * (N - mu * T) * mu
        own = jnp.sum(jnp.where(this_slot, u * scale, 0.0), -1)  # f_j^2 r_j of the row itself (0: the normal row)
        f = jnp.where(normal_row == jnp.arange(nrows)[None], normal_force, -normal_force / T * own)
        return jnp.where(on_cone, f, 0.0)

    return cone


# The rules' products of per-world (or per-contact) matrices and vectors are written as products and sums, which
# XLA fuses into one pass over the matrix, and not as einsums: at full float32 precision a batched matrix-vector
# product lowers on a GPU to cuBLAS's strided-batched GEMV, the largest item of the humanoid's backward at 8,192
# worlds in an H100 profile (with the contact Jacobian rule's per-row products, which that rule no longer forms).
def _matvec(A, x):
    """``A @ x`` per world (or contact slot): ``(w, n, m), (w, m) -> (w, n)``."""
    return jnp.sum(A * x[:, None, :], -1)


def _matvec_transposed(A, y):
    """``A.T @ y`` per world: ``(w, n, m), (w, n) -> (w, m)``."""
    return jnp.sum(A * y[:, :, None], 1)


def _spd_solve(A, b):
    """``A^-1 b`` per world for symmetric positive definite ``A`` (an inertia, or inertia plus ``J' D J``).

    By Cholesky, whose factor the solve's derivative reuses (``lax.custom_linear_solve``, as
    ``jax.scipy.linalg.solve(assume_a="pos")`` does), the factor held constant (``custom_linear_solve``
    differentiates the solve by solving again). On a CPU the factorization and the substitutions are Warp kernels,
    one thread per world (``warpnn_models._linear_algebra``, built without adjoints); elsewhere their pure-JAX
    references, column by column over every world at once (``jax.lax.platform_dependent`` picks by the platform
    compiled for). Measured (fwd+bwd of the humanoid's 20-step rollout, 2026-12-07): CPU, 64 worlds, kernels 3,820
    steps/s against JAX's 3,117 (each of the JAX loops' ``n`` steps an XLA operation of its own); H100, 1,024
    worlds, JAX 303k against the kernels' 236k (one GPU thread per world runs its 27 x 27 factorization alone,
    serially).
    Not LAPACK or cuSOLVER: jaxlib 0.10's batched LAPACK kernels split their batch over XLA's CPU thread pool and
    wait for the pieces, and two running at once (the inertia's and the constraint solver's solves, in a step's
    backward) waited on each other forever on a two-core machine (measured: 512 worlds' 27 x 27 LU factorizations,
    4,096 worlds' Cholesky, the humanoid's backward at 64 worlds); and cuSOLVER's factorization made the humanoid's
    backward at 8,192 worlds only 4% faster on an H200.
    """
    factor = jax.lax.platform_dependent(jax.lax.stop_gradient(A), cpu=cholesky, default=cholesky_reference)
    return jax.lax.custom_linear_solve(
        lambda x: _matvec(A, x), b, symmetric=True,
        solve=lambda _, x: jax.lax.platform_dependent(factor, x, cpu=cholesky_solve, default=cholesky_solve_reference))


def _lu_solve(A, b):
    """``A^-1 b`` per world for a square ``A`` that needs no pivoting (the ``implicit`` integrator's ``M - dt
    qDeriv``, which mujoco_warp's ``factor_solve_lu`` factorizes without pivoting too): LU in JAX, column by column
    over every world (``_linear_algebra.lu_reference``; not LAPACK, see :func:`_spd_solve`), the factors held
    constant and the solve differentiated by solving again (``lax.custom_linear_solve``: ``A``'s transpose for the
    cotangent)."""
    factors = lu_reference(jax.lax.stop_gradient(A))
    return jax.lax.custom_linear_solve(
        lambda x: _matvec(A, x), b, solve=lambda _, x: lu_solve_reference(factors, x),
        transpose_solve=lambda _, x: lu_solve_reference(factors, x, transpose=True))


def _quat_integrate(q, omega, dt):
    """mujoco_warp's ``math.quat_integrate`` (``q * exp(omega dt / 2)``, normalised; quaternions ``w, x, y, z``),
    written so that its derivative at ``omega = 0`` is right: ``sin(t |omega| / 2) omega / |omega|`` as
    ``omega t / 2 sinc(.)``, where mujoco_warp's ``normalize(omega)`` and ``length(omega)`` have a zero adjoint."""
    squared = jnp.sum(omega * omega, axis=-1, keepdims=True)
    nonzero = squared > 0
    angle = jnp.where(nonzero, dt * jnp.sqrt(jnp.where(nonzero, squared, 1.0)), 0.0)
    turn = jnp.concatenate([jnp.cos(angle / 2), omega * dt / 2 * jnp.sinc(angle / (2 * jnp.pi))], axis=-1)
    product = _quat_multiply(q / jnp.linalg.norm(q, axis=-1, keepdims=True), turn)
    return product / jnp.linalg.norm(product, axis=-1, keepdims=True)


def _position_rule(m):
    """``forward._next_position`` by a rule: its Warp adjoint is zero at zero angular velocity.

    mujoco_warp integrates a free or ball joint's quaternion with ``math.quat_integrate``, whose
    ``wp.normalize(omega)`` and ``wp.length(omega)`` have zero adjoints at ``omega = 0`` (mujoco_warp's own comment:
    "does that need proper zero gradient handling?"): a body at rest would get no gradient from its first step's
    rotation (measured: 0 where ``mj_step``'s finite differences give 2.5e-3 per unit of angular velocity). The
    rule is the same integration with the derivative right there (:func:`_quat_integrate`); hinge and slide joints
    ``qpos + dt qvel``.
    """
    import numpy as np
    from mujoco_warp._src import forward, types

    jnt_type, qposadr, dofadr = (np.asarray(a.numpy()) for a in (m.jnt_type, m.jnt_qposadr, m.jnt_dofadr))
    scalar = np.isin(jnt_type, (int(types.JointType.HINGE), int(types.JointType.SLIDE)))
    free, ball = jnt_type == int(types.JointType.FREE), jnt_type == int(types.JointType.BALL)

    def rule(before, after):
        qpos, qvel = before["qpos_in"], before["qvel_in"] * after["qvel_scale_in"]
        steps = before["opt_timestep"]
        dt = steps[jnp.arange(qpos.shape[0]) % steps.shape[0]][:, None, None]
        out = qpos.at[:, qposadr[scalar]].add(dt[:, 0] * qvel[:, dofadr[scalar]])
        for which, offset in ((free, 3), (ball, 0)):
            if which.any():
                if offset:  # (a free joint's position)
                    slots = qposadr[which][:, None] + np.arange(3)
                    out = out.at[:, slots].add(dt * qvel[:, dofadr[which][:, None] + np.arange(3)])
                quat = qposadr[which][:, None] + offset + np.arange(4)
                omega = qvel[:, dofadr[which][:, None] + offset + np.arange(3)]
                out = out.at[:, quat].set(_quat_integrate(qpos[:, quat], omega, dt))
        return {"qpos_out": out}

    return warpnn.StageRule(
        forward, "_next_position", rule, per_launch=True,
        reads=lambda opt_timestep, qpos_in, qvel_in, **_: {"opt_timestep": opt_timestep, "qpos_in": qpos_in,
                                                           "qvel_in": qvel_in},
        writes=lambda qpos_out, **_: {"qpos_out": qpos_out},
        # (every slot of qpos is some joint's, so the launch overwrites all of qpos_out: RK4's stages write it over
        # the last stage's positions, Euler's over qpos_in itself)
        ignores=lambda qpos_out, **_: {"qpos_out": qpos_out},
    )


def _per_world(a, nworld):
    """A Model array's rows for each of ``nworld`` worlds (mujoco_warp keeps one row for every world, or one for
    all: ``a[worldid % a.shape[0]]``)."""
    return a[jnp.arange(nworld) % a.shape[0]]


def _rotate(v, q):
    """mujoco_warp's ``math.rot_vec_quat``: ``v`` (``(..., 3)``) rotated by the quaternion ``q`` (``w, x, y, z``)."""
    w, u = q[..., :1], q[..., 1:]
    return (2.0 * jnp.sum(u * v, -1, keepdims=True) * u + (w * w - jnp.sum(u * u, -1, keepdims=True)) * v
            + 2.0 * w * jnp.cross(u, v))


def _quat_multiply(a, b):
    """mujoco_warp's ``math.mul_quat`` (``w, x, y, z``)."""
    w1, v1, w2, v2 = a[..., :1], a[..., 1:], b[..., :1], b[..., 1:]
    return jnp.concatenate([w1 * w2 - jnp.sum(v1 * v2, -1, keepdims=True), w1 * v2 + w2 * v1 + jnp.cross(v1, v2)], -1)


def _motion_cross(u, v):
    """mujoco_warp's ``math.motion_cross`` of two spatial motions (angular, then linear)."""
    return jnp.concatenate([jnp.cross(u[..., :3], v[..., :3]),
                            jnp.cross(u[..., 3:], v[..., :3]) + jnp.cross(u[..., :3], v[..., 3:])], -1)


def _motion_cross_force(v, f):
    """mujoco_warp's ``math.motion_cross_force`` of a spatial motion and a force (angular, then linear)."""
    return jnp.concatenate([jnp.cross(v[..., :3], f[..., :3]) + jnp.cross(v[..., 3:], f[..., 3:]),
                            jnp.cross(v[..., :3], f[..., 3:])], -1)


def _inert_vec(i, v):
    """mujoco_warp's ``math.inert_vec``: a body's spatial inertia (its 10 numbers) times a spatial motion."""
    return jnp.stack([
        i[..., 0] * v[..., 0] + i[..., 3] * v[..., 1] + i[..., 4] * v[..., 2] - i[..., 8] * v[..., 4]
        + i[..., 7] * v[..., 5],
        i[..., 3] * v[..., 0] + i[..., 1] * v[..., 1] + i[..., 5] * v[..., 2] + i[..., 8] * v[..., 3]
        - i[..., 6] * v[..., 5],
        i[..., 4] * v[..., 0] + i[..., 5] * v[..., 1] + i[..., 2] * v[..., 2] - i[..., 7] * v[..., 3]
        + i[..., 6] * v[..., 4],
        i[..., 8] * v[..., 1] - i[..., 7] * v[..., 2] + i[..., 9] * v[..., 3],
        i[..., 6] * v[..., 2] - i[..., 8] * v[..., 0] + i[..., 9] * v[..., 4],
        i[..., 7] * v[..., 0] - i[..., 6] * v[..., 1] + i[..., 9] * v[..., 5],
    ], -1)


def _tree_rules(m) -> list:
    """The tree walks over branches that share bodies, by rules (``warpnn.StageRule(per_launch=True)``).

    mujoco_warp walks the kinematic tree one thread per branch (a root-to-leaf chain of bodies,
    ``m.body_branches``): ``smooth._kinematics_branch`` (positions, orientations, joint anchors and axes),
    ``_comvel_branch`` (spatial velocities and ``cdof_dot``), ``_cacc_branch`` (bias accelerations). Where two
    branches share a body (a torso with two legs), both threads write it with the same value; a per-kernel adjoint
    would count its cotangent once per branch, so the tracer refuses those kernels. The rules are the same
    recursions body by body in JAX (parents precede their children in MuJoCo's body order), checked against the
    launches when the step is traced. A chain (one branch, or none shared) keeps the per-kernel adjoint the tracer
    proves right.
    """
    import numpy as np
    from mujoco_warp._src import smooth, types

    branches = np.asarray(m.body_branches.numpy())
    if branches.size == 0 or np.bincount(branches).max() <= 1:
        return []
    parent, jntnum, jntadr, dofadr, dofnum, mocapid = (
        np.asarray(a.numpy()) for a in (m.body_parentid, m.body_jntnum, m.body_jntadr, m.body_dofadr, m.body_dofnum,
                                        m.body_mocapid))
    jnt_type, qposadr = np.asarray(m.jnt_type.numpy()), np.asarray(m.jnt_qposadr.numpy())
    FREE, BALL, SLIDE = (int(t) for t in (types.JointType.FREE, types.JointType.BALL, types.JointType.SLIDE))
    nbody, njnt = len(parent), len(jnt_type)

    def kinematics(before, after):
        qpos = before["qpos_in"]
        world = lambda name: _per_world(before[name], qpos.shape[0])  # noqa: E731
        body_pos, body_quat, jnt_pos, jnt_axis, qpos0 = (
            world(n) for n in ("body_pos", "body_quat", "jnt_pos", "jnt_axis", "qpos0"))
        xpos, xquat = [before["xpos_out"][:, 0]], [before["xquat_out"][:, 0]]
        anchor, axis = list(before["xanchor_out"].transpose(1, 0, 2)), list(before["xaxis_out"].transpose(1, 0, 2))
        for b in range(1, nbody):
            j = jntadr[b]
            if jntnum[b] == 1 and jnt_type[j] == FREE:
                a = qposadr[j]
                pos, quat = qpos[:, a:a + 3], qpos[:, a + 3:a + 7]
                xpos.append(pos)
                xquat.append(quat / jnp.linalg.norm(quat, axis=-1, keepdims=True))
                anchor[j], axis[j] = pos, jnt_axis[:, j]
                continue
            if mocapid[b] >= 0:
                pos, quat = before["mocap_pos_in"][:, mocapid[b]], before["mocap_quat_in"][:, mocapid[b]]
            else:
                pos, quat = body_pos[:, b], body_quat[:, b]
            pos = _rotate(pos, xquat[parent[b]]) + xpos[parent[b]]
            quat = _quat_multiply(xquat[parent[b]], quat)
            for j in range(jntadr[b], jntadr[b] + jntnum[b]):
                a = qposadr[j]
                anchor[j] = _rotate(jnt_pos[:, j], quat) + pos
                axis[j] = _rotate(jnt_axis[:, j], quat)
                if jnt_type[j] == BALL:
                    turn = qpos[:, a:a + 4]
                    quat = _quat_multiply(quat, turn / jnp.linalg.norm(turn, axis=-1, keepdims=True))
                    pos = anchor[j] - _rotate(jnt_pos[:, j], quat)
                elif jnt_type[j] == SLIDE:
                    pos = pos + axis[j] * (qpos[:, a] - qpos0[:, a])[:, None]
                else:  # hinge
                    half = 0.5 * (qpos[:, a] - qpos0[:, a])[:, None]
                    quat = _quat_multiply(quat, jnp.concatenate([jnp.cos(half), jnt_axis[:, j] * jnp.sin(half)], -1))
                    pos = anchor[j] - _rotate(jnt_pos[:, j], quat)
            xpos.append(pos)
            xquat.append(quat / jnp.linalg.norm(quat, axis=-1, keepdims=True))
        return {"xpos_out": jnp.stack(xpos, 1), "xquat_out": jnp.stack(xquat, 1),
                "xanchor_out": jnp.stack(anchor, 1) if njnt else before["xanchor_out"],
                "xaxis_out": jnp.stack(axis, 1) if njnt else before["xaxis_out"]}

    def comvel(before, after):
        qvel, cdof = before["qvel_in"], before["cdof_in"]
        cvel, dot = [before["cvel_out"][:, 0]], list(before["cdof_dot_out"].transpose(1, 0, 2))
        for b in range(1, nbody):
            v, d = cvel[parent[b]], dofadr[b]
            for j in range(jntadr[b], jntadr[b] + jntnum[b]):
                n, moved = {FREE: 6, BALL: 3}.get(int(jnt_type[j]), 1), 3 if jnt_type[j] == FREE else 0
                for k in range(moved):  # a free joint's translation: no cdof_dot, moves the frame first
                    dot[d + k] = jnp.zeros_like(v)
                    v = v + cdof[:, d + k] * qvel[:, d + k, None]
                for k in range(moved, n):  # (each with the velocity before any of this joint's rotations)
                    dot[d + k] = _motion_cross(v, cdof[:, d + k])
                for k in range(moved, n):
                    v = v + cdof[:, d + k] * qvel[:, d + k, None]
                d += n
            cvel.append(v)
        return {"cvel_out": jnp.stack(cvel, 1), "cdof_dot_out": jnp.stack(dot, 1)}

    def cacc(before, after):
        qvel, qacc, cdof, cdof_dot = (before[n] for n in ("qvel_in", "qacc_in", "cdof_in", "cdof_dot_in"))
        local = cdof_dot * qvel[..., None] + jnp.where(after["flg_acc"], cdof * qacc[..., None], 0.0)
        acc = [before["cacc_out"][:, 0]]
        for b in range(1, nbody):
            acc.append(acc[parent[b]] + local[:, dofadr[b]:dofadr[b] + dofnum[b]].sum(1))
        return {"cacc_out": jnp.stack(acc, 1)}

    model = ("qpos0", "body_pos", "body_quat", "jnt_pos", "jnt_axis")
    return [
        warpnn.StageRule(
            smooth, "_kinematics_branch", kinematics, per_launch=True,
            reads=lambda **a: {n: a[n] for n in (*model, "qpos_in", "mocap_pos_in", "mocap_quat_in", "xpos_out",
                                                  "xquat_out", "xanchor_out", "xaxis_out")},
            writes=lambda **a: {n: a[n] for n in ("xpos_out", "xquat_out", "xanchor_out", "xaxis_out")}),
        warpnn.StageRule(
            smooth, "_comvel_branch", comvel, per_launch=True,
            reads=lambda **a: {n: a[n] for n in ("qvel_in", "cdof_in", "cvel_out", "cdof_dot_out")},
            writes=lambda **a: {n: a[n] for n in ("cvel_out", "cdof_dot_out")}),
        warpnn.StageRule(
            smooth, "_cacc_branch", cacc, per_launch=True,
            reads=lambda **a: {n: a[n] for n in ("qvel_in", "qacc_in", "cdof_in", "cdof_dot_in", "cacc_out")},
            writes=lambda **a: {n: a[n] for n in ("cacc_out",)}),
    ]


def _poly_force(linear, poly, x, odd=False):
    """mujoco_warp's ``util_misc._poly_force``: a spring's or damper's coefficient at ``x``, ``linear + poly[0] x
    + poly[1] x^2`` (``odd``: of ``|x|``, for a damper's force, odd in the velocity)."""
    x = jnp.abs(x) if odd else x
    return linear + poly[..., 0] * x + poly[..., 1] * x * x


def _safe_norm(v):
    """``|v|`` over the last axis, with a zero (not NaN) derivative at ``v = 0``."""
    squared = jnp.sum(v * v, axis=-1, keepdims=True)
    nonzero = squared > 0
    return jnp.where(nonzero, jnp.sqrt(jnp.where(nonzero, squared, 1.0)), 0.0)


def _quat_difference(q, ref):
    """mujoco_warp's ``math.quat_sub(q, ref)``: the rotation from ``ref`` to ``q`` as a 3D velocity, written so that
    its derivative at ``q = ref`` is right (``quat_to_vel`` returns 0 there through a branch on ``sin == 0``, whose
    adjoint is zero; its limit ``axis * 2 / w`` is the value and the derivative)."""
    conj = ref * jnp.array([1.0, -1.0, -1.0, -1.0], ref.dtype)
    d = _quat_multiply(conj, q)
    axis, w = d[..., 1:], d[..., :1]
    s = _safe_norm(axis)
    nonzero = s > 0
    speed = 2.0 * jnp.arctan2(s, w)
    speed = jnp.where(speed > jnp.pi, speed - 2.0 * jnp.pi, speed)
    return axis * jnp.where(nonzero, speed / jnp.where(nonzero, s, 1.0), 2.0 / jnp.where(nonzero, 1.0, w))


def _velocity_derivative_rule(m) -> list:
    """``derivative.deriv_smooth_vel(m, d, out)`` by a rule, for the ``implicitfast`` and ``implicit`` integrators:
    ``out = M - dt qDeriv`` in ``M``'s sparse layout, ``qDeriv`` the velocity derivative of the actuator and passive
    forces, which implicitfast then solves with (``smooth.factor_solve_i``, whose rule covers it) and implicit
    completes with the Coriolis forces' derivative (:func:`_implicit_rules`). Its kernels leave loops early and
    measure arrays inside ``@wp.func``s after use, which Warp's adjoint gets wrong (refused). The rule, as the
    kernels: each actuator's ``d force / d velocity`` (an affine bias's ``biasprm[2]``, plus an affine gain's
    ``gainprm[2]``, or a muscle's active force's velocity derivative, times its control, or with activation dynamics
    its activation, the next one where ``actearly``; 0 where ``forcerange`` clamps the force) times its moment's
    outer product; minus, on the diagonal, each dof's damping and its polynomial's derivative (the joint's
    actuators' ``damping`` times gear squared included); minus each tendon's damping (its actuators' included) times
    ``J_t' J_t``, on ``M``'s entries; 0 for an actuator whose joint's or tendon's total actuator force is at its
    ``actfrcrange``. Covered: gains fixed, affine or muscle, biases none, affine or muscle, activation dynamics
    integrator, filter, filterexact or muscle, no fluid forces, no control delays, actuation and damping enabled;
    for anything else the rule refuses, naming it, and so does reverse mode through the stage.
    """
    import numpy as np
    from mujoco_warp._src import derivative, types

    if m.opt.integrator not in (types.IntegratorType.IMPLICITFAST, types.IntegratorType.IMPLICIT):
        return []
    integrator = types.IntegratorType(m.opt.integrator).name.lower()

    def host(a):
        return np.asarray(a.numpy())

    gaintype, biastype, dyntype = host(m.actuator_gaintype), host(m.actuator_biastype), host(m.actuator_dyntype)
    # actuators whose joint's or tendon's total actuator force has a limit (derivative.py's _jnt_actfrc_clamped,
    # _tendon_actfrc_clamped: where the total is at its limit, the actuator's derivative is 0)
    trntype, trnid = host(m.actuator_trntype), host(m.actuator_trnid).reshape(-1, 2)[:, 0]
    on_trn_tendon = trntype == int(types.TrnType.TENDON)
    on_trn_joint = np.isin(trntype, (int(types.TrnType.JOINT), int(types.TrnType.JOINTINPARENT)))
    joint_limited = on_trn_joint & host(m.jnt_actfrclimited)[np.where(on_trn_joint, trnid, 0)] if m.njnt else \
        np.zeros_like(on_trn_joint)
    tendon_limited = on_trn_tendon & host(m.tendon_actfrclimited)[np.where(on_trn_tendon, trnid, 0)] \
        if m.ntendon else np.zeros_like(on_trn_tendon)
    limited_dof = host(m.jnt_dofadr)[np.where(joint_limited, trnid, 0)] if m.njnt else trnid
    dynamics = (types.DynType.INTEGRATOR, types.DynType.FILTER, types.DynType.FILTEREXACT, types.DynType.MUSCLE)
    off = int(m.opt.disableflags) & (int(types.DisableBit.ACTUATION) | int(types.DisableBit.DAMPER))
    unsupported = [reason for reason, present in (
        ("a gain other than fixed, affine or muscle",
         ~np.isin(gaintype, (types.GainType.FIXED, types.GainType.AFFINE, types.GainType.MUSCLE))),
        ("a bias other than none, affine or muscle",
         ~np.isin(biastype, (types.BiasType.NONE, types.BiasType.AFFINE, types.BiasType.MUSCLE))),
        ("activation dynamics other than integrator, filter, filterexact or muscle",
         ~np.isin(dyntype, (types.DynType.NONE, *dynamics))),
        ("fluid forces", np.array([bool(m.has_fluid)])),
        ("control delays", np.array([getattr(m, "nhistory", 0) > 0])),
        ("actuation or damping disabled", np.array([off != 0]))) if np.any(present)]
    affine_gain = (gaintype == int(types.GainType.AFFINE)).astype(np.float32)
    affine_bias = (biastype == int(types.BiasType.AFFINE)).astype(np.float32)
    muscle_gain = gaintype == int(types.GainType.MUSCLE)
    # the activation an affine gain multiplies (the actuator's last), and how it advances (support.next_act)
    actadr = host(m.actuator_actadr) + host(m.actuator_actnum) - 1
    stateful = (dyntype != int(types.DynType.NONE)) & (actadr >= 0)
    actadr = np.maximum(actadr, 0)  # (where stateful; any index elsewhere)
    early, exact = host(m.actuator_actearly) & stateful, dyntype == int(types.DynType.FILTEREXACT)
    actlimited = host(m.actuator_actlimited)
    forcelimited, nv, dof_jnt = host(m.actuator_forcelimited), m.nv, host(m.dof_jntid)
    on_joint, on_tendon = _actuators_on(m, tendons=False), _actuators_on(m, tendons=True)
    ten_entry, ten_row, ten_dof = _tendon_entries(m)
    entries, rows, cols = _inertia_entries(m)

    def rule(before, after):
        if unsupported:
            raise NotImplementedError(f"the {integrator} rule (derivative.deriv_smooth_vel) does not cover "
                                      + ", ".join(unsupported) + ", which this model has")
        qvel, M = before["qvel"], before["M"]
        nworld, dtype = qvel.shape[0], qvel.dtype
        world = lambda name: _per_world(before[name], nworld)  # noqa: E731
        timestep = world("opt.timestep")
        # what an affine gain multiplies: the control, or the activation (the next one where actearly)
        drive = before["ctrl"]
        if stateful.any():
            act = before["act"][:, actadr]
            if early.any():
                tau = jnp.maximum(types.MJ_MINVAL, world("actuator_dynprm")[..., 0])
                rate = jnp.where(exact, tau * (1.0 - jnp.exp(-timestep[:, None] / tau)), timestep[:, None])
                ahead = act + before["act_dot"][:, actadr] * rate
                limits = world("actuator_actrange")
                ahead = jnp.where(actlimited, jnp.clip(ahead, limits[..., 0], limits[..., 1]), ahead)
                act = jnp.where(early, ahead, act)
            drive = jnp.where(stateful, act, drive)
        # each actuator's d force / d velocity, and its moment as a dense row (sparse rows in the data: the entry e
        # belongs to the last actuator whose row starts at or before it)
        gain = world("actuator_gainprm")[..., 2] * affine_gain
        if muscle_gain.any():  # (util_misc.muscle_gain_vel_deriv)
            gain = jnp.where(muscle_gain, _muscle_gain_velocity_derivative(
                before["actuator_length"], before["actuator_velocity"], world("actuator_lengthrange"),
                world("actuator_acc0"), world("actuator_gainprm")), gain)
        vel = world("actuator_biasprm")[..., 2] * affine_bias + gain * drive
        if forcelimited.any():
            force, limits = after["actuator_force"], _per_world(after["actuator_forcerange"], nworld)
            clamped = forcelimited & ((force <= limits[..., 0]) | (force >= limits[..., 1]))
            vel = jnp.where(clamped, 0.0, vel)
        if joint_limited.any():  # (the joint's total at the dof, after its clamp)
            total = after["qfrc_actuator"][:, limited_dof]
            limits = _per_world(after["jnt_actfrcrange"], nworld)[:, np.where(joint_limited, trnid, 0)]
            vel = jnp.where(joint_limited & ((total <= limits[..., 0]) | (total >= limits[..., 1])), 0.0, vel)
        if tendon_limited.any():  # (the sum of the tendon's actuators' forces, within a relative 1e-5)
            tendon = np.where(on_trn_tendon, trnid, 0)
            per_tendon = jnp.zeros((nworld, m.ntendon), dtype).at[:, tendon].add(
                jnp.where(on_trn_tendon, after["actuator_force"], 0.0))
            total = per_tendon[:, tendon]
            limits = _per_world(after["tendon_actfrcrange"], nworld)[:, tendon]
            low, high = limits[..., 0] + 1e-5 * jnp.abs(limits[..., 0]), limits[..., 1] - 1e-5 * jnp.abs(limits[..., 1])
            vel = jnp.where(tendon_limited & ((total <= low) | (total >= high)), 0.0, vel)
        moment, start, count = before["actuator_moment"], after["moment_rowadr"], after["moment_rownnz"]
        element = jnp.arange(moment.shape[1])
        owner = jnp.sum(element[None, None, :] >= start[:, :, None], 1) - 1  # (world, entry)
        mine = jax.nn.one_hot(owner, vel.shape[1], dtype=dtype) * (
            element[None, :] < jnp.take_along_axis(start + count, jnp.maximum(owner, 0), 1))[..., None]
        dense = jnp.einsum("wea,we,wev->wav", mine, moment, jax.nn.one_hot(after["moment_colind"], nv, dtype=dtype),
                           precision=jax.lax.Precision.HIGHEST)  # (world, actuator, dof)
        qderiv = jnp.einsum("wa,wai,waj->wij", vel, dense, dense, precision=jax.lax.Precision.HIGHEST)
        # damping: the joints' and tendons' own, plus their actuators' times gear squared (util_misc's
        # dof_damping_total, tendon_damping_total); the force's derivative |v|-odd (util_misc._poly_force_deriv)
        gear = world("actuator_gear")

        def slope(linear, poly, on, speed):
            linear = _plus_actuators(linear, world("actuator_damping"), gear, on)
            poly = _plus_actuators(poly, world("actuator_dampingpoly"), gear, on)
            return linear + 2.0 * poly[..., 0] * speed + 3.0 * poly[..., 1] * speed * speed

        dof = slope(world("dof_damping"), world("dof_dampingpoly"), on_joint[dof_jnt], jnp.abs(qvel[:, :nv]))
        qderiv -= jax.vmap(jnp.diag)(dof)
        if m.ntendon:
            tendon = slope(world("tendon_damping"), world("tendon_dampingpoly"), on_tendon,
                           jnp.abs(before["ten_velocity"]))
            J = jnp.zeros((nworld, m.ntendon, nv), dtype).at[:, ten_row, ten_dof].set(
                before["ten_J"][:, ten_entry])
            qderiv -= jnp.einsum("wt,wti,wtj->wij", tendon, J, J, precision=jax.lax.Precision.HIGHEST)
        out = M[:, entries] - timestep[:, None] * qderiv[:, rows, cols]
        return {"out": after["out"].at[:, entries].set(out)}

    floats = ("opt.timestep", "actuator_biasprm", "actuator_gainprm", "actuator_dynprm", "actuator_actrange",
              "actuator_gear", "actuator_damping", "actuator_dampingpoly", "actuator_lengthrange", "actuator_acc0",
              "dof_damping", "dof_dampingpoly", "tendon_damping", "tendon_dampingpoly")

    def model_arrays(m):
        return {n: m.opt.timestep if n == "opt.timestep" else getattr(m, n) for n in floats}

    return [warpnn.StageRule(
        derivative, "deriv_smooth_vel", rule,
        reads=lambda m, d, out: {"M": d.M, "qvel": d.qvel, "ctrl": d.ctrl, "act": d.act, "act_dot": d.act_dot,
                                 "actuator_moment": d.actuator_moment, "ten_J": d.ten_J,
                                 "ten_velocity": d.ten_velocity, "actuator_length": d.actuator_length,
                                 "actuator_velocity": d.actuator_velocity, **model_arrays(m)},
        writes=lambda m, d, out: {"out": out},
        context=lambda m, d, out: {"actuator_force": d.actuator_force, "qfrc_actuator": d.qfrc_actuator,
                                   "jnt_actfrcrange": m.jnt_actfrcrange, "tendon_actfrcrange": m.tendon_actfrcrange,
                                   "actuator_forcerange": m.actuator_forcerange, "moment_rowadr": d.moment_rowadr,
                                   "moment_rownnz": d.moment_rownnz, "moment_colind": d.moment_colind},
        # (what the covered actuators' derivative does not depend on: the forces but for the clamp test, a choice
        # with no derivative; out is zeroed first)
        ignores=lambda m, d, out: {"qfrc_actuator": d.qfrc_actuator, "actuator_force": d.actuator_force},
    )]


def _muscle_gain_velocity_derivative(length, velocity, lengthrange, acc0, prm):
    """``util_misc.muscle_gain_vel_deriv``: a muscle's active force's derivative in its velocity, per actuator
    (``prm``: range, force, scale, lmin, lmax, vmax, fpmax, fvmax), with ``muscle_gain_length``'s curve."""
    from mujoco_warp._src.types import MJ_MINVAL

    low, high, force, scale, lmin, lmax, vmax, fvmax = (prm[..., i] for i in (0, 1, 2, 3, 4, 5, 6, 8))
    force = jnp.where(force < 0.0, scale / jnp.maximum(MJ_MINVAL, acc0), force)
    L0 = (lengthrange[..., 1] - lengthrange[..., 0]) / jnp.maximum(MJ_MINVAL, high - low)
    L = low + (length - lengthrange[..., 0]) / jnp.maximum(MJ_MINVAL, L0)
    V = velocity / jnp.maximum(MJ_MINVAL, L0 * vmax)
    a, b = 0.5 * (lmin + 1.0), 0.5 * (1.0 + lmax)  # (the length curve: quadratic pieces, maximum 1 at L = 1)
    rising = 0.5 * jnp.square((L - lmin) / jnp.maximum(MJ_MINVAL, a - lmin))
    below_one = 1.0 - 0.5 * jnp.square((1.0 - L) / jnp.maximum(MJ_MINVAL, 1.0 - a))
    above_one = 1.0 - 0.5 * jnp.square((L - 1.0) / jnp.maximum(MJ_MINVAL, b - 1.0))
    falling = 0.5 * jnp.square((lmax - L) / jnp.maximum(MJ_MINVAL, lmax - b))
    FL = jnp.where((lmin > L) | (L > lmax), 0.0, jnp.where(
        L <= a, rising, jnp.where(L <= 1.0, below_one, jnp.where(L <= b, above_one, falling))))
    y = fvmax - 1.0
    dFV = jnp.where(V <= -1.0, 0.0, jnp.where(V <= 0.0, 2.0 * V + 2.0, jnp.where(
        V <= y, (-2.0 * V + 2.0 * y) / jnp.maximum(MJ_MINVAL, y), 0.0)))
    return -force * FL * dFV / jnp.maximum(MJ_MINVAL, L0 * vmax)


def _implicit_rules(m) -> list:
    """The ``implicit`` integrator's stages after ``deriv_smooth_vel`` (:func:`_velocity_derivative_rule`), by rules:

    * ``derivative.deriv_rne_vel(m, d, out)`` adds ``dt d(qfrc_bias)/d(qvel)`` (the Coriolis and centrifugal forces'
      derivative) to ``out`` in the D layout (``qD_fullm_i/j``): four tree walks, one of which adds each body's
      derivative into its parent's with atomics while reading its own from the same array (refused). The rule is
      the same recursions body by body in JAX (the tree's levels in order, then reversed): each body's velocity and
      each dof's ``cdof_dot`` differentiated w.r.t. every ``qvel_k``, then its bias acceleration and force, the
      forces summed up the tree and projected on the dofs' ``cdof``.
    * ``smooth.factor_solve_lu(m, d, qLU, qacc, qfrc)`` factorizes the non-symmetric ``qLU`` in place and solves
      (its kernel reads what it wrote: refused). Rule: the solve (:func:`_lu_solve`); ``qLU``'s factors get no
      gradient (nothing after the solve reads them).
    """
    import numpy as np
    from mujoco_warp._src import derivative, smooth, types

    if m.opt.integrator != types.IntegratorType.IMPLICIT:
        return []
    parent, jntnum, jntadr, dofadr, dofnum = (np.asarray(a.numpy()) for a in (
        m.body_parentid, m.body_jntnum, m.body_jntadr, m.body_dofadr, m.body_dofnum))
    jnt_type, dof_bodyid = np.asarray(m.jnt_type.numpy()), np.asarray(m.dof_bodyid.numpy())
    FREE, BALL = int(types.JointType.FREE), int(types.JointType.BALL)
    levels = [np.asarray(level.numpy()) for level in m.body_tree]
    rows_D, cols_D = np.asarray(m.qD_fullm_i.numpy()), np.asarray(m.qD_fullm_j.numpy())
    nv = m.nv

    def coriolis(before, after):
        qvel, cdof, cinert, cvel, cdof_dot = (before[n] for n in ("qvel", "cdof", "cinert", "cvel", "cdof_dot"))
        nworld = qvel.shape[0]
        zero = jnp.zeros((nworld, nv, 6), qvel.dtype)  # (world, k, spatial): d(.)/d(qvel_k)
        dcvel, dcdof_dot = {0: zero}, {}
        for b in (int(b) for level in levels for b in level):  # d cvel, d cdof_dot (deriv_rne_cvel_cdof_dot)
            v, d = dcvel.get(int(parent[b]), zero), dofadr[b]
            for j in range(jntadr[b], jntadr[b] + jntnum[b]):
                n, moved = {FREE: 6, BALL: 3}.get(int(jnt_type[j]), 1), 3 if jnt_type[j] == FREE else 0
                for k in range(d, d + moved):  # (a free joint's first three dofs: no cdof_dot)
                    v = v.at[:, k].add(cdof[:, k])
                for k in range(d + moved, d + n):  # (each with the velocity before any of this joint's own)
                    dcdof_dot[k] = _motion_cross(v, cdof[:, k, None])
                for k in range(d + moved, d + n):
                    v = v.at[:, k].add(cdof[:, k])
                d += n
            dcvel[b] = v
        dcacc, dforce = {0: zero}, {}
        for b in (int(b) for level in levels for b in level):  # d cacc, d cfrc_body (deriv_rne_cacc_cfrcbody_...)
            a = dcacc.get(int(parent[b]), zero)
            for j in range(dofadr[b], dofadr[b] + dofnum[b]):
                a = a.at[:, j].add(cdof_dot[:, j])
                if j in dcdof_dot:
                    a = a + dcdof_dot[j] * qvel[:, j, None, None]
            dcacc[b] = a
            inertia, velocity, dv = cinert[:, b, None], cvel[:, b, None], dcvel[b]
            dforce[b] = (_inert_vec(inertia, a) + _motion_cross_force(dv, _inert_vec(inertia, velocity))
                         + _motion_cross_force(velocity, _inert_vec(inertia, dv)))
        for level in reversed(levels):  # (deriv_rne_cfrcbody_backward: children into parents)
            for b in (int(b) for b in level):
                p = int(parent[b])
                if p in dforce:
                    dforce[p] = dforce[p] + dforce[b]
        body_force = jnp.stack([dforce.get(int(dof_bodyid[i]), zero) for i in range(nv)], 1)  # (world, i, k, 6)
        term = jnp.sum(cdof[:, rows_D] * body_force[:, rows_D, cols_D], -1)
        return {"out": before["out"] + _per_world(before["opt.timestep"], nworld)[:, None] * term}

    entries, rows, cols = _csr_entries(m.D_rownnz, m.D_rowadr, m.D_colind)

    def lu(before, after):
        qLU = before["qLU"]
        A = jnp.zeros((qLU.shape[0], nv, nv), qLU.dtype).at[:, rows, cols].set(qLU[:, entries])
        return {"qacc": _lu_solve(A, before["qfrc"])}

    return [
        warpnn.StageRule(
            derivative, "deriv_rne_vel", coriolis,
            reads=lambda m, d, out: {"out": out, "qvel": d.qvel, "cdof": d.cdof, "cinert": d.cinert, "cvel": d.cvel,
                                     "cdof_dot": d.cdof_dot, "opt.timestep": m.opt.timestep},
            writes=lambda m, d, out: {"out": out}),
        warpnn.StageRule(
            smooth, "factor_solve_lu", lu,
            reads=lambda m, d, qLU, qacc, qfrc: {"qLU": qLU, "qfrc": qfrc},
            writes=lambda m, d, qLU, qacc, qfrc: {"qacc": qacc},
            ignores=lambda m, d, qLU, qacc, qfrc: {"qacc": qacc}),  # (overwritten)
    ]


def _applied_force_rule(m):
    """``support._apply_ft`` by a rule: it maps each body's applied force and torque (``xfrc_applied``, fluid forces)
    to the dofs whose subtree holds the body, and skips a body whose force is exactly zero (``if ft_body ==
    wp.spatial_vector(): continue``). The map is linear in the force, so Warp's adjoint, which sees the branch
    taken, gives a zero derivative w.r.t. every body left unforced: measured, d/d(xfrc_applied) at zero was 0
    where ``mj_step``'s central differences give up to 8.6 (a step of the branching tree). The rule sums every body
    of the subtree, as the kernel's formula otherwise.
    """
    import numpy as np
    from mujoco_warp._src import support

    rootid, dof_bodyid, subtreenum = (np.asarray(a.numpy()) for a in (m.body_rootid, m.dof_bodyid,
                                                                       m.body_subtreenum))
    in_subtree = np.zeros((len(dof_bodyid), len(subtreenum)), bool)  # [dof, body]: the body moves with the dof
    for dof, body in enumerate(dof_bodyid):
        in_subtree[dof, body:body + subtreenum[body]] = True
    root_com = rootid[dof_bodyid]  # (each dof's lever arms are taken about its tree root's subtree centre of mass)

    def rule(before, after):
        cdof, ft, xipos = before["cdof_in"], before["ft_in"], before["xipos_in"]  # cdof: rotation, then translation
        force, torque = ft[..., :3], ft[..., 3:]  # (xfrc_applied's order)
        com = before["subtree_com_in"][:, root_com]  # (nworld, nv, 3)
        # sum over the subtree of lin . f + rot . (t + (xipos - com) x f), the sums taken first
        subtree = jnp.asarray(in_subtree, ft.dtype)
        f_sum = jnp.einsum("vb,wbk->wvk", subtree, force)
        t_sum = jnp.einsum("vb,wbk->wvk", subtree, torque + jnp.cross(xipos, force)) - jnp.cross(com, f_sum)
        qfrc = jnp.sum(cdof[..., 3:] * f_sum + cdof[..., :3] * t_sum, -1)
        return {"qfrc_out": before["qfrc_out"] + qfrc if "qfrc_out" in before else qfrc}  # (read: flg_add)

    def reads(flg_add, **a):  # (qfrc_out too where the launch adds to it)
        names = ("xipos_in", "subtree_com_in", "cdof_in", "ft_in") + (("qfrc_out",) if flg_add else ())
        return {n: a[n] for n in names}

    return warpnn.StageRule(
        support, "_apply_ft", rule, per_launch=True, reads=reads,
        writes=lambda qfrc_out, **_: {"qfrc_out": qfrc_out},
        ignores=lambda qfrc_out, flg_add, **_: {} if flg_add else {"qfrc_out": qfrc_out},  # (overwritten)
    )


def _actuators_on(m, tendons: bool):
    """Which actuators add their damping or armature (times gear squared) to each joint (``tendons=False``) or
    tendon, as mujoco_warp's ``util_misc.actuator_target_damping`` and ``actuator_target_armature`` pick them: a
    bool ``(njnt or ntendon, nu)``. ``jnt_actuatorid`` / ``tendon_actuatorid`` name the one actuator, or -1 for
    none, or < -1 for every actuator whose transmission targets it (``util_misc._actuator_target``)."""
    import numpy as np
    from mujoco_warp._src import types

    owner = np.asarray((m.tendon_actuatorid if tendons else m.jnt_actuatorid).numpy())
    trntype, trnid = np.asarray(m.actuator_trntype.numpy()), np.asarray(m.actuator_trnid.numpy()).reshape(-1, 2)
    kinds = (int(types.TrnType.TENDON),) if tendons else (int(types.TrnType.JOINT), int(types.TrnType.JOINTINPARENT))
    on = np.zeros((len(owner), len(trntype)), bool)
    for target, k in enumerate(owner):
        if k >= 0:
            on[target, k] = True
        elif k < -1:
            on[target] = (trnid[:, 0] == target) & np.isin(trntype, kinds)
    return on


def _plus_actuators(own, per_actuator, gear, on):
    """A joint's or tendon's damping, damping polynomial or armature with its actuators' (``util_misc``'s
    ``actuator_target_damping`` / ``_armature``): ``own[w, t, ...] + sum_a on[t, a] per_actuator[w, a, ...]
    gear[w, a, 0]^2``, ``on`` from :func:`_actuators_on`."""
    gear2 = gear[..., 0] ** 2
    scaled = per_actuator * gear2.reshape(gear2.shape + (1,) * (per_actuator.ndim - 2))
    return own + jnp.einsum("wa...,ta->wt...", scaled, jnp.asarray(on, own.dtype))


def _tendon_entries(m):
    """The entries of the tendons' sparse Jacobian rows (``ten_J``'s layout): each entry's index in ``ten_J``, its
    tendon and its dof, in order."""
    return _csr_entries(m.ten_J_rownnz, m.ten_J_rowadr, m.ten_J_colind)


def _tendon_products(m):
    """``ten_J``'s sparse rows as the two sums the tendon kernels take over a row's entries: ``rows(J, v)``, each
    tendon's ``J_t . v`` (``(world, ntendon)``), and ``columns(J, f)``, ``J' f`` per dof (``(world, nv)``); ``J``
    in ``ten_J``'s layout (``ten_J`` or ``ten_Jdot``)."""
    entry, tendon, dof = _tendon_entries(m)

    def rows(J, v):
        return jnp.zeros((v.shape[0], m.ntendon), v.dtype).at[:, tendon].add(J[:, entry] * v[:, dof])

    def columns(J, f):
        return jnp.zeros((f.shape[0], m.nv), f.dtype).at[:, dof].add(J[:, entry] * f[:, tendon])

    return rows, columns


def _tendon_armature_rule(m):
    """``smooth._tendon_armature`` by a rule: it adds each tendon's armature ``a_t`` (its own plus its actuators'
    armature times gear squared) times ``J_t' J_t`` to the inertia, entry by entry along each dof's ancestors, in a
    while loop that walks the tendon's sparse Jacobian row (refused: Warp's adjoint does not run it again), and
    skips an entry whose Jacobian element is exactly 0 (whose derivative is not 0). Rule: the same sums, every
    entry of the row's sparsity, each inertia entry ``M[madr] += a_t J_ti J_tj`` as one scatter-add over the model's
    fixed list of (tendon, i, j, madr).
    """
    import numpy as np
    from mujoco_warp._src import smooth

    rownnz, rowadr, colind, parent, m_rowadr, m_rownnz = (
        np.asarray(a.numpy()) for a in (m.ten_J_rownnz, m.ten_J_rowadr, m.ten_J_colind, m.dof_parentid, m.M_rowadr,
                                        m.M_rownnz))
    terms = []  # (tendon, sparse index of J_ti, of J_tj, inertia entry (i, j)), j = i and each ancestor of i
    for t in range(m.ntendon):
        column = {int(colind[rowadr[t] + k]): int(rowadr[t] + k) for k in range(rownnz[t])}
        for i, at_i in column.items():
            entry, j = m_rowadr[i] + m_rownnz[i] - 1, i
            while j >= 0:
                if j in column:
                    terms.append((t, at_i, column[j], entry))
                entry, j = entry - 1, parent[j]
    tendon, at_i, at_j, entry = (np.asarray(c, np.int32) for c in zip(*terms)) if terms else [np.zeros(0, np.int32)] * 4
    on_tendon = _actuators_on(m, tendons=True)  # (the actuators whose armature each tendon adds)

    def rule(before, after):
        J, M = before["ten_J_in"], before["M_out"]
        nworld = J.shape[0]
        armature = _plus_actuators(*(_per_world(before[n], nworld) for n in (
            "tendon_armature", "actuator_armature", "actuator_gear")), on_tendon)
        return {"M_out": M.at[:, entry].add(armature[:, tendon] * J[:, at_i] * J[:, at_j])}

    return warpnn.StageRule(
        smooth, "_tendon_armature", rule, per_launch=True,
        reads=lambda **a: {n: a[n] for n in ("tendon_armature", "actuator_armature", "actuator_gear", "ten_J_in",
                                              "M_out")},
        writes=lambda M_out, **_: {"M_out": M_out},
    )


def _tendon_dot_rule(m) -> list:
    """``smooth._tendon_dot`` (the time derivative of a spatial tendon's Jacobian, for its armature's bias force) by
    a rule where every tendon is fixed: its threads leave before writing where a tendon has no armature or is fixed
    (a fixed tendon's Jacobian is constant), so the launch writes nothing; but where a tendon's armature is a
    parameter the launch-time proof of that (``warpnn._idle``) stops at the armature's test, and the kernel's while
    loop is refused. Rule: ``ten_Jdot`` as it was. With a spatial tendon no rule: the launch-time proof covers
    armatures that are constants and 0, and the kernel's refusal stands for the rest."""
    import numpy as np
    from mujoco_warp._src import smooth, types

    if any(kind != int(types.TendonType.FIXED) for kind in np.asarray(m.tendon_type.numpy())):
        return []
    return [warpnn.StageRule(
        smooth, "_tendon_dot", lambda before, after: {"ten_Jdot_out": before["ten_Jdot_out"]}, per_launch=True,
        reads=lambda ten_Jdot_out, **_: {"ten_Jdot_out": ten_Jdot_out},
        writes=lambda ten_Jdot_out, **_: {"ten_Jdot_out": ten_Jdot_out},
        # (what a spatial tendon's Jacobian derivative would read; a fixed tendon's reads none of it)
        ignores=lambda **a: {n: a[n] for n in ("tendon_armature", "wrap_prm", "actuator_armature", "actuator_gear",
                                                "site_xpos_in", "subtree_com_in", "cdof_in", "cvel_in",
                                                "cdof_dot_in")},
    )]


def _jacobian_chain(body, parent, dofadr, dofnum) -> list:
    """The dofs ``smooth._accumulate_jac_chain`` walks from ``body`` up to the world: the body's, its parent's, ..."""
    dofs = []
    while body > 0:
        dofs += range(dofadr[body], dofadr[body] + dofnum[body])
        body = parent[body]
    return dofs


def _tendon_site_rules(m) -> list:
    """A spatial tendon's length and Jacobian between sites, and every tendon's velocity, by rules.

    * ``smooth._spatial_site_tendon`` adds, per pair of consecutive sites, the distance (times a pulley's scale) to
      the length and ``d distance / d qvel`` to the Jacobian, walking each site's chain of bodies, and skips a
      Jacobian term that is exactly 0 (``if J != 0.0``: a site whose motion is perpendicular to the segment), whose
      derivative is not 0: the equality guard made the gradient NaN (measured: a tendon between sites on an arm's
      two links). Rule: the same sums over the model's fixed list of (pair, dof) terms.
    * ``forward._tendon_velocity`` sums ``J qvel`` over a row and skips exactly-zero entries the same way. Rule:
      the sum.
    """
    import numpy as np
    from mujoco_warp._src import forward, smooth

    if not m.ntendon:
        return []
    rows, _ = _tendon_products(m)
    rules = [warpnn.StageRule(
        forward, "_tendon_velocity", lambda before, after: {
            "ten_velocity_out": rows(before["ten_J_in"], before["qvel_in"])}, per_launch=True,
        reads=lambda qvel_in, ten_J_in, **_: {"qvel_in": qvel_in, "ten_J_in": ten_J_in},
        writes=lambda ten_velocity_out, **_: {"ten_velocity_out": ten_velocity_out})]
    pair_adr, pair_tendon = (np.asarray(a.numpy()) for a in (m.wrap_site_pair_adr, m.tendon_site_pair_adr))
    if not pair_adr.size:
        return rules
    objid, pulley = np.asarray(m.wrap_objid.numpy()), np.asarray(m.wrap_pulley_scale.numpy())
    site_body, root, parent, dofadr, dofnum = (np.asarray(a.numpy()) for a in (
        m.site_bodyid, m.body_rootid, m.body_parentid, m.body_dofadr, m.body_dofnum))
    place = {(int(t), int(d)): int(e) for e, t, d in zip(*_tendon_entries(m))}  # (tendon, dof) -> ten_J entry
    site0, site1 = objid[pair_adr], objid[pair_adr + 1]
    scale = pulley[pair_adr].astype(np.float32)
    terms = []  # (pair, end: 0 or 1, dof, ten_J entry, sign) of each Jacobian term _accumulate_jac_chain adds
    for pair, (t, a, b) in enumerate(zip(pair_tendon, site0, site1)):
        if site_body[a] == site_body[b]:
            continue
        for end, (site, sign) in enumerate(((a, -1.0), (b, 1.0))):
            terms += [(pair, end, dof, place[(int(t), dof)], sign)
                      for dof in _jacobian_chain(site_body[site], parent, dofadr, dofnum) if (int(t), dof) in place]
    pair_of, end_of, dof_of, entry_of, sign_of = (
        np.array(c) for c in zip(*terms)) if terms else (np.zeros(0, int),) * 5

    def site_tendon(before, after):
        from mujoco_warp._src.types import MJ_MINVAL

        xpos, com, cdof = before["site_xpos_in"], before["subtree_com_in"], before["cdof_in"]
        p0, p1 = xpos[:, site0], xpos[:, site1]  # (world, pair, 3)
        length = jnp.linalg.norm(p1 - p0, axis=-1)
        short = length < MJ_MINVAL  # (normalize_with_norm, then a fixed direction below MJ_MINVAL)
        vec = jnp.where(short[..., None], jnp.asarray([1.0, 0.0, 0.0], xpos.dtype),
                        (p1 - p0) / jnp.where(short, 1.0, length)[..., None])
        out_length = before["ten_length_out"].at[:, pair_tendon].add(length * scale)
        ends = jnp.stack([p0 - com[:, root[site_body[site0]]], p1 - com[:, root[site_body[site1]]]], 2)
        offset = ends[:, pair_of, end_of]  # (world, term, 3)
        motion = cdof[:, dof_of]
        jacp = motion[..., 3:] + jnp.cross(motion[..., :3], offset)
        J = jnp.sum(jacp * vec[:, pair_of], -1) * (sign_of * scale[pair_of]).astype(xpos.dtype)
        return {"ten_length_out": out_length, "ten_J_out": before["ten_J_out"].at[:, entry_of].add(J)}

    return rules + [warpnn.StageRule(
        smooth, "_spatial_site_tendon", site_tendon, per_launch=True,
        reads=lambda **a: {n: a[n] for n in ("site_xpos_in", "subtree_com_in", "cdof_in", "ten_J_out",
                                              "ten_length_out")},
        writes=lambda ten_J_out, ten_length_out, **_: {"ten_J_out": ten_J_out, "ten_length_out": ten_length_out})]


def _tendon_geom_rule(m) -> list:
    """``smooth._spatial_geom_tendon`` by a rule: each site-geom-site stretch of a spatial tendon, wrapped around
    the sphere or cylinder where the straight path would cross it (``util_misc.wrap``), adds its length and its
    Jacobian. The kernel walks each end's chain of bodies in a while loop (refused) and skips exactly-zero Jacobian
    terms (NaN under the equality guard, as the site tendons' did); ``wrap_inside`` (a side site inside the geom)
    iterates Newton's method in a while loop. Rule: :func:`warpnn_models._tendon_wrap.wrap` in JAX and the same
    sums over the model's fixed list of (stretch, point, dof) terms, each on where the stretch wraps or where it
    does not. The wrap points (``wrap_geom_xpos``, read by the path below) are the rule's too."""
    import numpy as np
    from mujoco_warp._src import smooth, types
    from mujoco_warp._src.types import MJ_MINVAL

    from ._tendon_wrap import wrap

    adr = np.asarray(m.wrap_geom_adr.numpy())
    if not adr.size:
        return []
    tendon, objid, kind, prm, pulley, site_body, geom_body, root, parent, dofadr, dofnum = (
        np.asarray(a.numpy()) for a in (m.tendon_geom_adr, m.wrap_objid, m.wrap_type, m.wrap_prm,
                                        m.wrap_pulley_scale, m.site_bodyid, m.geom_bodyid, m.body_rootid,
                                        m.body_parentid, m.body_dofadr, m.body_dofnum))
    site0, geom, site1 = objid[adr - 1], objid[adr], objid[adr + 1]
    side = np.round(prm[adr]).astype(np.int32)
    has_side, side = side >= 0, np.maximum(side, 0)
    cylinder = kind[adr] == int(types.WrapType.CYLINDER)
    scale = pulley[adr].astype(np.float32)
    # each stretch's four points (site, the geom's two, site) and the body each moves with
    bodies = np.stack([site_body[site0], geom_body[geom], geom_body[geom], site_body[site1]], 1)
    place = {(int(t), int(d)): int(e) for e, t, d in zip(*_tendon_entries(m))}  # (tendon, dof) -> ten_J entry
    terms = []  # (stretch, point, segment: site-geom 0, geom-site 1, site-site 2, dof, ten_J entry, sign)
    for e, t in enumerate(tendon):
        t = int(t)
        for segment, (first, second) in enumerate(((0, 1), (2, 3), (0, 3))):
            if bodies[e, first] == bodies[e, second]:
                continue
            for point, sign in ((first, -1.0), (second, 1.0)):
                terms += [(e, point, segment, dof, place[(t, dof)], sign)
                          for dof in _jacobian_chain(bodies[e, point], parent, dofadr, dofnum) if (t, dof) in place]
    stretch_of, point_of, segment_of, dof_of, entry_of, sign_of = (
        np.array(c) for c in zip(*terms)) if terms else (np.zeros(0, int),) * 6

    def direction(d):  # (the segment's unit vector, or x where it is shorter than MJ_MINVAL; a derivative, not
        norm = _safe_norm(d)[..., 0]  # NaN, at 0: a stretch that does not wrap has its geom points at its ends)
        short = norm < MJ_MINVAL
        return jnp.where(short[..., None], jnp.asarray([1.0, 0.0, 0.0], d.dtype),
                         d / jnp.where(short, 1.0, norm)[..., None]), norm

    def geom_tendon(before, after):
        xpos, com, cdof = before["site_xpos_in"], before["subtree_com_in"], before["cdof_in"]
        nworld = xpos.shape[0]
        x0, x1 = xpos[:, site0], xpos[:, site1]  # (world, stretch, 3)
        radius = _per_world(before["geom_size"], nworld)[:, geom, 0]
        wrapped_length, g0, g1 = wrap(x0, x1, before["geom_xpos_in"][:, geom], before["geom_xmat_in"][:, geom],
                                      radius, jnp.asarray(cylinder), xpos[:, side], jnp.asarray(has_side))
        wrapped = wrapped_length >= 0.0
        on_geom0 = jnp.where(wrapped[..., None], g0, x0)  # (MJ_MAXVAL where it does not wrap: not used there)
        on_geom1 = jnp.where(wrapped[..., None], g1, x1)
        to_geom, to_geom_length = direction(on_geom0 - x0)
        from_geom, from_geom_length = direction(x1 - on_geom1)
        straight, straight_length = direction(x1 - x0)
        length = jnp.where(wrapped, to_geom_length + wrapped_length + from_geom_length, straight_length)
        out_length = before["ten_length_out"].at[:, tendon].add(length * scale)
        points = jnp.stack([x0, on_geom0, on_geom1, x1], 2)  # (world, stretch, 4, 3)
        offset = (points - com[:, root[bodies]])[:, stretch_of, point_of]  # (world, term, 3)
        vec = jnp.stack([to_geom, from_geom, straight], 2)[:, stretch_of, segment_of]
        on = jnp.stack([wrapped, wrapped, ~wrapped], 2)[:, stretch_of, segment_of]
        motion = cdof[:, dof_of]
        jacp = motion[..., 3:] + jnp.cross(motion[..., :3], offset)
        J = jnp.where(on, jnp.sum(jacp * vec, -1) * (sign_of * scale[stretch_of]).astype(xpos.dtype), 0.0)
        geom_points = before["wrap_geom_xpos_out"].at[:, :adr.size].set(jnp.concatenate([g0, g1], -1))
        return {"ten_length_out": out_length, "ten_J_out": before["ten_J_out"].at[:, entry_of].add(J),
                "wrap_geom_xpos_out": geom_points}

    return [warpnn.StageRule(
        smooth, "_spatial_geom_tendon", geom_tendon, per_launch=True,
        reads=lambda **a: {n: a[n] for n in ("site_xpos_in", "geom_xpos_in", "geom_xmat_in", "geom_size",
                                              "subtree_com_in", "cdof_in", "ten_J_out", "ten_length_out",
                                              "wrap_geom_xpos_out")},
        writes=lambda **a: {n: a[n] for n in ("ten_J_out", "ten_length_out", "wrap_geom_xpos_out")})]


def _tendon_path_rule(m) -> list:
    """``smooth._spatial_tendon_wrap`` (the points of each spatial tendon's path, ``wrap_xpos``: for drawing it, and
    for the forces on bodies ``rne_postconstraint`` computes) by a rule: one thread per world walks every tendon in
    a while loop (refused). Each point is a site's position, zeros at a pulley, or one of the two points where a
    stretch wraps a geom, which it adds only where it wraps: the walk is the model's, each world's slots shift by
    two after every stretch that wraps (``wrap_geom_xpos``'s first point is ``MJ_MAXVAL`` where it does not). The
    rule takes the same walk and places each point at its world's slot."""
    import numpy as np
    from mujoco_warp._src import smooth, types
    from mujoco_warp._src.types import MJ_MAXVAL

    tendon_type, adr, num = (np.asarray(a.numpy()) for a in (m.tendon_type, m.tendon_adr, m.tendon_num))
    kind, objid, geom_adr = (np.asarray(a.numpy()) for a in (m.wrap_type, m.wrap_objid, m.wrap_geom_adr))
    PULLEY = int(types.WrapType.PULLEY)
    GEOMS = (int(types.WrapType.SPHERE), int(types.WrapType.CYLINDER))
    SITE, FIRST, SECOND, ZERO = range(4)  # (what a point is: a site, a wrapped stretch's first or second, zeros)
    # the kernel's walk: steps (the geom stretch there or -1; a step takes 1 slot, 3 where its stretch wraps) and
    # points (step, slot in the step, what, which site or stretch, the stretch whose wrap it needs or -1); it meets
    # the geom stretches in wrap_geom_xpos's order (mujoco_warp's io lays them out so; checked: in_order)
    steps, points = [], []
    stretch, in_order = 0, True
    for t in np.flatnonzero(tendon_type != int(types.TendonType.FIXED)):
        first, j = adr[t], 0
        while j < num[t] - 1:
            k0, k1 = kind[first + j], kind[first + j + 1]
            if k0 == PULLEY or k1 == PULLEY:
                if k0 == PULLEY:
                    points.append((len(steps), 0, ZERO, 0, -1))
                    steps.append(-1)
                j += 1
                continue
            if k1 in GEOMS:  # (site, geom, site: the geom's two points where it wraps)
                in_order &= stretch < geom_adr.size and geom_adr[stretch] == first + j + 1
                points += [(len(steps), 0, SITE, objid[first + j], -1), (len(steps), 1, FIRST, stretch, stretch),
                           (len(steps), 2, SECOND, stretch, stretch)]
                steps.append(stretch)
                stretch, last, j = stretch + 1, objid[first + j + 2], j + 2
            else:
                points.append((len(steps), 0, SITE, objid[first + j], -1))
                steps.append(-1)
                last, j = objid[first + j + 1], j + 1
            if j == num[t] - 1 or (first + j + 1 < kind.size and kind[first + j + 1] == PULLEY):
                points.append((len(steps), 0, SITE, last, -1))  # (the last site before a pulley or the end)
                steps.append(-1)
    if not points:
        return []
    step_wraps = np.array(steps, np.int32)
    step_of, slot_in_step, what, which, needs = (np.array(c, np.int32) for c in zip(*points))
    geoms = bool(geom_adr.size)  # (without geom stretches wrap_geom_xpos is never written: not read either)

    def rule(before, after):
        if not in_order:
            raise NotImplementedError("the tendon path rule walks the tendons' geom stretches in the order "
                                      "mujoco_warp's io lays them out in (wrap_geom_adr); this model's differ")
        out = before["wrap_xpos_out"]
        nworld = out.shape[0]
        xpos = before["site_xpos_in"]
        if geoms:
            geom_points = before["wrap_geom_xpos_in"][:, :geom_adr.size]
            wrapped = jnp.linalg.norm(geom_points[..., :3], axis=-1) < MJ_MAXVAL  # (world, stretch)
        else:  # (no geom stretch: nothing to read, no point needs one)
            geom_points, wrapped = jnp.zeros((nworld, 1, 6), xpos.dtype), jnp.zeros((nworld, 1), bool)
        size = jnp.where(step_wraps >= 0, 1 + 2 * wrapped[:, np.maximum(step_wraps, 0)].astype(jnp.int32), 1)
        slot = (jnp.cumsum(size, axis=1) - size)[:, step_of] + slot_in_step  # (world, point)
        present = (needs < 0) | wrapped[:, np.maximum(needs, 0)]
        slot = jnp.where(present, slot, 2 * out.shape[1])  # (past the end: dropped)
        geom = geom_points[:, np.minimum(which, geom_points.shape[1] - 1)]
        value = jnp.select([what[:, None] == SITE, what[:, None] == FIRST, what[:, None] == SECOND],
                           [xpos[:, np.minimum(which, xpos.shape[1] - 1)], geom[..., :3], geom[..., 3:]], 0.0)
        placed = out.reshape(nworld, -1, 3).at[jnp.arange(nworld)[:, None], slot].set(value, mode="drop")
        return {"wrap_xpos_out": placed.reshape(out.shape)}

    return [warpnn.StageRule(
        smooth, "_spatial_tendon_wrap", rule, per_launch=True,
        reads=lambda site_xpos_in, wrap_xpos_out, wrap_geom_xpos_in, **_: {
            "site_xpos_in": site_xpos_in, "wrap_xpos_out": wrap_xpos_out,
            **({"wrap_geom_xpos_in": wrap_geom_xpos_in} if geoms else {})},
        writes=lambda wrap_xpos_out, **_: {"wrap_xpos_out": wrap_xpos_out},
        ignores=lambda wrap_geom_xpos_in, **_: {} if geoms else {"wrap_geom_xpos_in": wrap_geom_xpos_in},
    )]


def _tendon_bias_rules(m) -> list:
    """``smooth._tendon_bias_coef`` and ``_tendon_bias_qfrc`` (a tendon armature's bias force, ``J_t a_t (Jdot_t .
    qvel)``) by rules: their threads leave where the armature ``a_t`` (its actuators' armature times gear squared
    included) is exactly 0, and where a Jacobian entry is. The force is continuous there, but its derivative in the
    armature is not 0 (``J_t (Jdot_t . qvel)``), and Warp's adjoint of the branch taken gives 0; the equality guard
    made the gradient of everything the armature depends on NaN instead (a tendon motor's gear: measured, NaN where
    ``mj_step``'s central difference is 0.112). Rules: the same sums without the branches. For a fixed tendon
    ``Jdot`` is 0 (:func:`_tendon_dot_rule`), so both add 0 and the values agree with the launches."""
    from mujoco_warp._src import smooth

    on_tendon = _actuators_on(m, tendons=True)
    rows, columns = _tendon_products(m)

    def coefficient(before, after):
        return {"ten_bias_coef_out": before["ten_bias_coef_out"] + rows(before["ten_Jdot_in"], before["qvel_in"])}

    def force(before, after):
        qfrc = before["qfrc_out"]
        armature = _plus_actuators(*(_per_world(before[n], qfrc.shape[0]) for n in (
            "tendon_armature", "actuator_armature", "actuator_gear")), on_tendon)
        return {"qfrc_out": qfrc + columns(before["ten_J_in"], armature * before["ten_bias_coef_in"])}

    armature = ("tendon_armature", "actuator_armature", "actuator_gear")
    return [
        warpnn.StageRule(
            smooth, "_tendon_bias_coef", coefficient, per_launch=True,
            reads=lambda **a: {n: a[n] for n in ("qvel_in", "ten_Jdot_in", "ten_bias_coef_out")},
            writes=lambda ten_bias_coef_out, **_: {"ten_bias_coef_out": ten_bias_coef_out},
            ignores=lambda **a: {n: a[n] for n in armature},  # (a switch only: the sum does not depend on it)
        ),
        warpnn.StageRule(
            smooth, "_tendon_bias_qfrc", force, per_launch=True,
            reads=lambda **a: {n: a[n] for n in (*armature, "ten_J_in", "ten_bias_coef_in", "qfrc_out")},
            writes=lambda qfrc_out, **_: {"qfrc_out": qfrc_out},
        ),
    ]


def _sensor_pos_rule(m) -> list:
    """``sensor._sensor_pos`` (the position-stage sensors) by a rule: one kernel computes every kind, and its
    geom-distance branch carries the nearest distance through a dynamic loop Warp's adjoint does not run again, so
    the kernel is refused whole, whichever sensors a model has. The rule computes the common kinds as the kernel
    does: joint, tendon and actuator positions, a ball joint's normalised quaternion, a frame's position, axes and
    quaternion (of a body's inertial frame, a body, a geom, a site or a camera, in the world or in another such
    frame), a subtree's centre of mass, the clock, a magnetometer (the field in a site's frame), a camera's projection
    of a site (pixels), an inside-site test (0 or 1: piecewise constant, so its derivative is 0), the energies as
    the energy stage left them, the geom distances, normals and from-to segments (the nearest of the collision
    stage's points for the sensor's geom pairs: :func:`_geom_distance`); each clamped by its ``cutoff``
    (``[-cutoff, cutoff]``, or ``<= cutoff`` for positive data; a from-to segment is not). A model with another
    kind gets the rule's refusal naming it.
    """
    import numpy as np
    from mujoco_warp._src import sensor, types

    S, O = types.SensorType, types.ObjType

    def host(a):
        return np.asarray(a.numpy())

    ids = host(m.sensor_pos_adr)
    if not ids.size:
        return []
    kind, objtype, objid, reftype, refid, adr, datatype, qposadr = (host(a) for a in (
        m.sensor_type, m.sensor_objtype, m.sensor_objid, m.sensor_reftype, m.sensor_refid, m.sensor_adr,
        m.sensor_datatype, m.jnt_qposadr))
    collision_kinds = {int(S.GEOMDIST), int(S.GEOMNORMAL), int(S.GEOMFROMTO)}
    covered = collision_kinds | {int(k) for k in (
        S.JOINTPOS, S.TENDONPOS, S.ACTUATORPOS, S.BALLQUAT, S.FRAMEPOS, S.FRAMEXAXIS, S.FRAMEYAXIS, S.FRAMEZAXIS,
        S.FRAMEQUAT, S.SUBTREECOM, S.CLOCK, S.MAGNETOMETER, S.CAMPROJECTION, S.INSIDESITE, S.E_POTENTIAL,
        S.E_KINETIC)}
    collisions = _sensor_collision_entries(m, [i for i in ids if int(kind[i]) in collision_kinds])
    site_type, cam_resolution = host(m.site_type), host(m.cam_resolution).reshape(-1, 2)
    # (_get_quat: a frame's orientation is its body's times its own, but for a body's own frame, XBODY)
    local_quats = {int(O.BODY): ("body_iquat", None), int(O.GEOM): ("geom_quat", host(m.geom_bodyid)),
                   int(O.SITE): ("site_quat", host(m.site_bodyid)), int(O.CAMERA): ("cam_quat", host(m.cam_bodyid))}
    others = sorted({S(int(kind[i])).name for i in ids if int(kind[i]) not in covered})
    frames = {int(O.BODY): ("xipos_in", "ximat_in"), int(O.XBODY): ("xpos_in", "xmat_in"),
              int(O.GEOM): ("geom_xpos_in", "geom_xmat_in"), int(O.SITE): ("site_xpos_in", "site_xmat_in"),
              int(O.CAMERA): ("cam_xpos_in", "cam_xmat_in")}
    axes = {int(S.FRAMEXAXIS): 0, int(S.FRAMEYAXIS): 1, int(S.FRAMEZAXIS): 2}

    def rule(before, after):
        if others:
            raise NotImplementedError(f"the position sensors' rule does not cover {others}, which this model has")
        out = before["sensordata_out"]
        cutoff = before["sensor_cutoff"]

        def frame(part, typ, obj):  # (_get_pos / _get_mat: a position (w, 3) or a rotation (w, 3, 3))
            if int(typ) not in frames:
                raise NotImplementedError(f"a frame sensor on object type {int(typ)}")
            return before[frames[int(typ)][part]][:, obj]

        def orientation(typ, obj):
            if int(typ) == int(O.XBODY):
                return before["xquat_in"][:, obj]
            if int(typ) not in local_quats:
                raise NotImplementedError(f"a frame sensor on object type {int(typ)}")
            name, body = local_quats[int(typ)]
            own = _per_world(before[name], out.shape[0])[:, obj]
            return _quat_multiply(before["xquat_in"][:, obj if body is None else body[obj]], own)

        for i in ids:
            k, obj = int(kind[i]), int(objid[i])
            if k == int(S.JOINTPOS):
                value = before["qpos_in"][:, qposadr[obj], None]
            elif k == int(S.TENDONPOS):
                value = before["ten_length_in"][:, obj, None]
            elif k == int(S.ACTUATORPOS):
                value = before["actuator_length_in"][:, obj, None]
            elif k == int(S.BALLQUAT):
                q = before["qpos_in"][:, qposadr[obj]:qposadr[obj] + 4]
                value = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
            elif k == int(S.SUBTREECOM):
                value = before["subtree_com_in"][:, obj]
            elif k == int(S.CLOCK):
                value = jnp.broadcast_to(before["time_in"], out.shape[:1])[:, None]
            elif k in (int(S.E_POTENTIAL), int(S.E_KINETIC)):
                value = before["energy_in"][:, int(k == int(S.E_KINETIC)), None]
            elif k == int(S.MAGNETOMETER):  # (site_xmat' magnetic)
                value = jnp.einsum("wji,wj->wi", before["site_xmat_in"][:, obj],
                                   _per_world(before["opt_magnetic"], out.shape[0]),
                                   precision=jax.lax.Precision.HIGHEST)
            elif k == int(S.CAMPROJECTION):
                value = _camera_projection(before, out.shape[0], obj, int(refid[i]), cam_resolution[int(refid[i])])
            elif k == int(S.INSIDESITE):
                value = _inside_site(before, out.shape[0], int(objtype[i]), obj, int(refid[i]),
                                     int(site_type[int(refid[i])]))
            elif k in collision_kinds:
                value = _geom_distance(before["sensor_collision_in"], cutoff[i], k, *collisions[int(i)])
            elif k == int(S.FRAMEQUAT):  # (quat_inv(ref) * quat)
                value = orientation(objtype[i], obj)
                if refid[i] >= 0:
                    inverse = jnp.asarray([1.0, -1.0, -1.0, -1.0], value.dtype)
                    value = _quat_multiply(orientation(reftype[i], int(refid[i])) * inverse, value)
            else:  # a frame's position or axis, in the world or in the reference frame
                if k == int(S.FRAMEPOS):
                    value = frame(0, objtype[i], obj)
                    if refid[i] >= 0:
                        value = value - frame(0, reftype[i], int(refid[i]))
                else:
                    value = frame(1, objtype[i], obj)[..., axes[k]]
                if refid[i] >= 0:  # (xmat_ref' v)
                    value = jnp.einsum("wji,wj->wi", frame(1, reftype[i], int(refid[i])), value,
                                       precision=jax.lax.Precision.HIGHEST)
            c = cutoff[i]
            if k == int(S.GEOMFROMTO):  # (a segment's ends: not clamped)
                pass
            elif datatype[i] == int(types.DataType.REAL):
                value = jnp.where(c > 0, jnp.clip(value, -c, c), value)
            elif datatype[i] == int(types.DataType.POSITIVE):
                value = jnp.where(c > 0, jnp.minimum(value, c), value)
            out = out.at[:, adr[i]:adr[i] + value.shape[1]].set(value)
        return {"sensordata_out": out}

    floats = ("qpos_in", "ten_length_in", "actuator_length_in", "subtree_com_in", "time_in", "xpos_in", "xmat_in",
              "xipos_in", "ximat_in", "geom_xpos_in", "geom_xmat_in", "site_xpos_in", "site_xmat_in", "cam_xpos_in",
              "cam_xmat_in", "xquat_in", "body_iquat", "geom_quat", "site_quat", "cam_quat", "sensor_cutoff",
              "opt_magnetic", "body_mass", "body_subtreemass", "site_size", "cam_fovy", "cam_sensorsize",
              "cam_intrinsic", "energy_in", "sensordata_out")
    # (the geom distances' input: read where the model has them)
    floats += ("sensor_collision_in",) * bool(collisions)
    return [warpnn.StageRule(
        sensor, "_sensor_pos", rule, per_launch=True,
        reads=lambda **a: {n: a[n] for n in floats},
        writes=lambda sensordata_out, **_: {"sensordata_out": sensordata_out},
        ignores=lambda sensor_collision_in, **_: {} if collisions else {"sensor_collision_in": sensor_collision_in},
    )]


def _sensor_collision_entries(m, sensors) -> dict:
    """For each geom distance, normal or from-to sensor in ``sensors``: the rows of ``sensor_collision`` (the
    collision stage's nearest points, 8 per geom pair) it reads, one per pair of its geoms (a body's geoms, or a
    geom), and whether each pair's normal points from the sensor's second geom to its first (``_sensor_pos``'s
    ``flip``: the collision functions order a pair by geom type, then by id)."""
    import numpy as np
    from mujoco_warp._src import types

    geom_type, geomadr, geomnum, objtype, objid, reftype, refid = (np.asarray(a.numpy()) for a in (
        m.geom_type, m.body_geomadr, m.body_geomnum, m.sensor_objtype, m.sensor_objid, m.sensor_reftype,
        m.sensor_refid))
    nxn = np.asarray(m.nxn_pairid.numpy()).reshape(-1, 2)

    def geoms(typ, obj):
        return range(geomadr[obj], geomadr[obj] + geomnum[obj]) if typ == int(types.ObjType.BODY) else [obj]

    entries = {}
    for i in sensors:
        rows, flips = [], []
        for g1 in geoms(objtype[i], objid[i]):
            for g2 in geoms(reftype[i], refid[i]):
                lo, hi = min(g1, g2), max(g1, g2)
                rows.append(nxn[(lo * (2 * m.ngeom - lo - 3)) // 2 + hi - 1, 1])  # (math.upper_tri_index)
                flips.append(geom_type[g1] > geom_type[g2] or (geom_type[g1] == geom_type[g2] and g1 > g2))
        entries[int(i)] = (np.array(rows, np.int32), np.repeat(np.array(flips, bool), 8))
    return entries


def _geom_distance(collision, cutoff, kind, rows, flips):
    """``_sensor_pos``'s geom distance, normal or from-to segment (``(world, 1, 3 or 6)``): the nearest of the
    collision stage's points for the sensor's geom pairs (``collision``: ``(world, ncollision, 8, 7)``, distance,
    position, normal; ``1e32`` where there is none) below ``cutoff``, the first where several are nearest, as the
    kernel's strict comparison keeps; the normal turned to point from the first geom to the second."""
    from mujoco_warp._src import types

    nworld = collision.shape[0]
    points = collision[:, rows].reshape(nworld, -1, 7)  # (world, pair x 8, 7)
    distances = jnp.concatenate([jnp.broadcast_to(cutoff, (nworld, 1)).astype(points.dtype), points[..., 0]], 1)
    best = jnp.argmin(distances, axis=1)  # (0: none below the cutoff)
    dist = jnp.take_along_axis(distances, best[:, None], 1)[:, 0]
    found = best > 0
    nearest = jnp.take_along_axis(points, jnp.maximum(best - 1, 0)[:, None, None], 1)[:, 0]
    pos = jnp.where(found[:, None], nearest[:, 1:4], 0.0)
    normal = jnp.where(found[:, None], nearest[:, 4:7], 0.0)
    flip = found & jnp.asarray(flips)[jnp.maximum(best - 1, 0)]
    segment = jnp.where(((dist >= cutoff) | (dist == 0.0))[:, None], 0.0,
                        jnp.where((flip != (dist < 0.0))[:, None], -normal, normal))
    if kind == int(types.SensorType.GEOMDIST):
        return dist[:, None]
    if kind == int(types.SensorType.GEOMNORMAL):
        return segment
    half = 0.5 * jnp.abs(dist)[:, None] * segment
    return jnp.where((dist < cutoff)[:, None], jnp.concatenate([pos - half, pos + half], 1), 0.0)


def _kinetic_energy_rule():
    """``sensor._energy_vel_kinetic`` (the kinetic energy, ``0.5 qvel' (M qvel)``, where ``opt.enableflags`` has
    ``energy``) sums by ``wp.tile_reduce``, which Warp has no adjoint for (the kernel is refused). Rule: the same
    sum."""
    from mujoco_warp._src import sensor

    def rule(before, after):
        kinetic = 0.5 * jnp.sum(before["qvel_in"] * before["Mqvel"], axis=-1)
        return {"energy_out": before["energy_out"].at[:, 1].set(kinetic)}

    return warpnn.StageRule(
        sensor, "_energy_vel_kinetic", rule, per_launch=True,
        reads=lambda qvel_in, Mqvel, energy_out: {"qvel_in": qvel_in, "Mqvel": Mqvel, "energy_out": energy_out},
        writes=lambda energy_out, **_: {"energy_out": energy_out},
    )


def _camera_projection(before, nworld, site, camera, resolution):
    """``sensor._cam_projection``: a site's position in pixels of a camera (``resolution`` read on the host)."""
    from mujoco_warp._src.types import MJ_MINVAL
    xmat, xpos = before["cam_xmat_in"][:, camera], before["cam_xpos_in"][:, camera]
    v = jnp.einsum("wji,wj->wi", xmat, before["site_xpos_in"][:, site] - xpos, precision=jax.lax.Precision.HIGHEST)
    sensorsize = before["cam_sensorsize"][camera]
    intrinsic = _per_world(before["cam_intrinsic"], nworld)[:, camera]
    fovy = _per_world(before["cam_fovy"], nworld)[:, camera]
    width, height = (float(r) for r in resolution)
    # (focal lengths from the intrinsics where the camera has a sensor size, else from the vertical field of view)
    from_fovy = 0.5 / jnp.tan(fovy * (jnp.pi / 360.0)) * height
    has_size = (sensorsize[0] != 0.0) & (sensorsize[1] != 0.0)
    fx = jnp.where(has_size, intrinsic[:, 0] / (sensorsize[0] + MJ_MINVAL) * width, from_fovy)
    fy = jnp.where(has_size, intrinsic[:, 1] / (sensorsize[1] + MJ_MINVAL) * height, from_fovy)
    denom = jnp.where(jnp.abs(v[:, 2]) < MJ_MINVAL, jnp.where(v[:, 2] < 0.0, -MJ_MINVAL, MJ_MINVAL), v[:, 2])
    return jnp.stack([-fx * v[:, 0], fy * v[:, 1]], axis=-1) / denom[:, None] + 0.5 * jnp.asarray([width, height])


def _inside_site(before, nworld, objtype, obj, site, site_type):
    """``sensor._sensor_pos``'s inside-site test (``util_misc.inside_geom``): 1.0 where an object's position lies
    inside a site's primitive, else 0.0. Piecewise constant in every input, so its derivative is 0 wherever it is
    defined; ``stop_gradient`` says so rather than leaving comparisons to JAX."""
    from mujoco_warp._src import types

    O, G, MJ_MINVAL = types.ObjType, types.GeomType, types.MJ_MINVAL
    if objtype == int(O.BODY) and obj > 0:  # (a massless body with mass below it: its subtree's centre)
        massless = ((_per_world(before["body_mass"], nworld)[:, obj] < MJ_MINVAL)
                    & (_per_world(before["body_subtreemass"], nworld)[:, obj] >= MJ_MINVAL))
        point = jnp.where(massless[:, None], before["subtree_com_in"][:, obj], before["xipos_in"][:, obj])
    else:
        point = before[{int(O.XBODY): "xpos_in", int(O.BODY): "xipos_in", int(O.GEOM): "geom_xpos_in",
                        int(O.SITE): "site_xpos_in", int(O.CAMERA): "cam_xpos_in"}[objtype]][:, obj]
    vec = jax.lax.stop_gradient(point - before["site_xpos_in"][:, site])
    size = jax.lax.stop_gradient(before["site_size"][site])
    local = jnp.einsum("wji,wj->wi", jax.lax.stop_gradient(before["site_xmat_in"][:, site]), vec,
                       precision=jax.lax.Precision.HIGHEST)
    square = lambda a: a * a  # noqa: E731
    inside = {
        int(G.SPHERE): lambda: jnp.sum(vec * vec, -1) < square(size[0]),
        int(G.CAPSULE): lambda: (square(local[:, 0]) + square(local[:, 1])
                                 + square(local[:, 2] - jnp.clip(local[:, 2], -size[1], size[1])) < square(size[0])),
        int(G.ELLIPSOID): lambda: jnp.sum(square(local / size), -1) < 1.0,
        int(G.CYLINDER): lambda: (jnp.abs(local[:, 2]) < size[1]) & (square(local[:, 0]) + square(local[:, 1])
                                                                     < square(size[0])),
        int(G.BOX): lambda: jnp.all(jnp.abs(local) < size, -1),
        int(G.PLANE): lambda: local[:, 2] < 0.0,
    }.get(site_type, lambda: jnp.zeros(vec.shape[:1], bool))()
    return inside.astype(vec.dtype)[:, None]


def _transmission_rule(m) -> list:
    """``smooth._transmission`` by a rule where every actuator drives a joint (``TrnType.JOINT`` or
    ``JOINTINPARENT``): a ball joint's actuator length is ``gear . quat_to_vel(q)``, and ``quat_to_vel`` returns 0
    through a branch on ``sin == 0`` at the identity orientation, every ball joint's default pose. Warp's adjoint of
    the branch taken gave d(length)/d(qpos) = 0 there, where the derivative is ``2 gear`` (measured on the tree with a
    position servo on its ball joint: 0 against up to 47 from central differences of ``mj_step``; the equality
    guard makes it NaN without this rule). The rule computes lengths and moments as the kernel does, through
    :func:`_quat_difference` (the derivative right at the identity). Other transmissions (tendons, sites, slider-
    cranks, bodies) keep Warp's adjoint, guarded, and a model with any of them gets no rule.
    """
    import numpy as np
    from mujoco_warp._src import smooth, types

    if not m.nu:
        return []
    trntype, trnid = np.asarray(m.actuator_trntype.numpy()), np.asarray(m.actuator_trnid.numpy()).reshape(-1, 2)
    in_parent = trntype == int(types.TrnType.JOINTINPARENT)
    if not np.isin(trntype, (int(types.TrnType.JOINT), int(types.TrnType.JOINTINPARENT))).all():
        return []
    jnt_type, qposadr = np.asarray(m.jnt_type.numpy()), np.asarray(m.jnt_qposadr.numpy())
    FREE, BALL = int(types.JointType.FREE), int(types.JointType.BALL)
    identity = jnp.array([1.0, 0.0, 0.0, 0.0])
    conjugate = jnp.array([1.0, -1.0, -1.0, -1.0])

    def rule(before, after):
        qpos = before["qpos_in"]
        nworld = qpos.shape[0]
        gear = _per_world(before["actuator_gear"], nworld)
        rowadr = after["moment_rowadr_out"]
        lengths, moment = [], jnp.zeros(after["actuator_moment_out"].shape, qpos.dtype)
        for a, (j, parent) in enumerate(zip(trnid[:, 0], in_parent)):
            kind, q = jnt_type[j], qposadr[j]
            if kind in (FREE, BALL):
                q = q + 3 if kind == FREE else q
                rot = qpos[:, q:q + 4] / jnp.linalg.norm(qpos[:, q:q + 4], axis=-1, keepdims=True)
                if kind == FREE:
                    length = jnp.zeros(nworld, qpos.dtype)
                    angular = _rotate(gear[:, a, 3:], rot * conjugate) if parent else gear[:, a, 3:]
                    values = jnp.concatenate([gear[:, a, :3], angular], -1)
                else:
                    axis = _rotate(gear[:, a, :3], rot * conjugate) if parent else gear[:, a, :3]
                    length = jnp.sum(_quat_difference(rot, identity.astype(qpos.dtype)) * axis, -1)
                    values = axis
            else:
                length, values = qpos[:, q] * gear[:, a, 0], gear[:, a, :1]
            lengths.append(length)
            columns = rowadr[:, a, None] + jnp.arange(values.shape[1])
            moment = moment.at[jnp.arange(nworld)[:, None], columns].set(values)
        return {"actuator_length_out": jnp.stack(lengths, 1), "actuator_moment_out": moment}

    floats = ("actuator_cranklength", "site_quat", "xquat_in", "site_xpos_in", "site_xmat_in", "subtree_com_in",
              "cdof_in", "ten_J_in", "ten_length_in")
    return [warpnn.StageRule(
        smooth, "_transmission", rule, per_launch=True,
        reads=lambda qpos_in, actuator_gear, **_: {"qpos_in": qpos_in, "actuator_gear": actuator_gear},
        writes=lambda **a: {n: a[n] for n in ("actuator_length_out", "actuator_moment_out")},
        context=lambda **a: {n: a[n] for n in ("moment_rowadr_out", "actuator_moment_out")},
        # joint transmissions read none of the other transmissions' inputs (the rule exists only for them), and
        # the launch writes every length and every moment entry
        ignores=lambda **a: {n: a[n] for n in (*floats, "actuator_length_out", "actuator_moment_out")},
    )]


def _passive_rule(m):
    """``passive._spring_damper_dof_passive`` by a rule: it skips a joint's spring, or a dof's damper, whose
    coefficients are exactly zero (``if damping != 0.0``), and a ball or free joint's rotational spring at its
    reference orientation (``quat_to_vel``'s ``if sin == 0``). The force is continuous across those points and
    not zero in its derivative there (``d(-damping qvel)/d damping = -qvel`` at ``damping = 0``), so Warp's
    adjoint, which sees the branch taken, gives 0 where ``mj_step``'s finite differences do not (measured: the
    free joint's ``dof_damping`` gradient, 0 against up to 8e-2). The rule computes every joint's spring and every
    dof's damper without the branches (:func:`_quat_difference`), as the kernel's formulas otherwise.
    """
    import numpy as np
    from mujoco_warp._src import passive, types

    jnt_type, qposadr, dofadr, plasticadr = (
        np.asarray(a.numpy()) for a in (m.jnt_type, m.jnt_qposadr, m.jnt_dofadr, m.jnt_plasticadr))
    on_dof = _actuators_on(m, tendons=False)[np.asarray(m.dof_jntid.numpy())]  # (whose damping each dof adds)
    FREE, BALL = int(types.JointType.FREE), int(types.JointType.BALL)
    spring_off, damper_off = int(types.DisableBit.SPRING), int(types.DisableBit.DAMPER)

    def rule(before, after):
        qpos, qvel = before["qpos_in"], before["qvel_in"]
        nworld = qpos.shape[0]
        world = lambda name: _per_world(before[name], nworld)  # noqa: E731
        ref_q, stiffness, spoly, gear = (world(n) for n in ("qpos_spring", "jnt_stiffness", "jnt_stiffnesspoly",
                                                             "actuator_gear"))
        damping = _plus_actuators(world("dof_damping"), world("actuator_damping"), gear, on_dof)
        dpoly = _plus_actuators(world("dof_dampingpoly"), world("actuator_dampingpoly"), gear, on_dof)
        plastic = before["plastic_in"]
        flags = after["opt_disableflags"]
        spring, damper = [None] * qvel.shape[1], [None] * qvel.shape[1]
        for j, kind in enumerate(jnt_type):
            q, d, p = qposadr[j], dofadr[j], plasticadr[j]
            k_lin, k_poly = stiffness[:, j, None], spoly[:, j, None]
            poly = lambda x: _poly_force(k_lin, k_poly, x)  # noqa: E731
            if kind in (FREE, BALL):
                parts = []
                if kind == FREE:
                    dif = qpos[:, q:q + 3] - ref_q[:, q:q + 3]
                    parts.append(-poly(_safe_norm(dif)) * dif)
                    q += 3
                rot = qpos[:, q:q + 4] / jnp.linalg.norm(qpos[:, q:q + 4], axis=-1, keepdims=True)
                ref = plastic[:, p:p + 4] if kind == BALL and p >= 0 else ref_q[:, q:q + 4]
                dif = _quat_difference(rot, ref)
                parts.append(-poly(_safe_norm(dif)) * dif)
                force = jnp.concatenate(parts, -1)
            else:
                ref = plastic[:, p] if p >= 0 else ref_q[:, q]
                dif = (qpos[:, q] - ref)[:, None]
                force = -dif * poly(dif)
            force = jnp.where((flags & spring_off) != 0, 0.0, force)
            n = force.shape[1]
            c, c_poly = damping[:, d:d + n], dpoly[:, d:d + n]
            v = qvel[:, d:d + n]
            friction = -v * _poly_force(c, c_poly, v, odd=True)
            friction = jnp.where((flags & damper_off) != 0, 0.0, friction)
            for i in range(n):
                spring[d + i], damper[d + i] = force[:, i], friction[:, i]
        return {"qfrc_spring_out": jnp.stack(spring, 1), "qfrc_damper_out": jnp.stack(damper, 1)}

    floats = ("qpos_spring", "jnt_stiffness", "jnt_stiffnesspoly", "dof_damping", "dof_dampingpoly", "actuator_damping",
              "actuator_dampingpoly", "actuator_gear", "qpos_in", "qvel_in", "plastic_in")
    return warpnn.StageRule(
        passive, "_spring_damper_dof_passive", rule, per_launch=True,
        reads=lambda **a: {n: a[n] for n in floats},
        writes=lambda **a: {n: a[n] for n in ("qfrc_spring_out", "qfrc_damper_out")},
        ignores=lambda **a: {n: a[n] for n in ("qfrc_spring_out", "qfrc_damper_out")},  # (every dof overwritten)
    )


def _tendon_passive_rule(m) -> list:
    """``passive._spring_damper_tendon_passive`` by a rule: it skips a tendon whose spring's or damper's coefficients
    are all exactly zero (``has_stiffness = stiffness != 0.0 or ...``), where the force's derivative in them is not
    zero (``-x`` for the stiffness, ``-v`` for the damping), and the equality guard makes their gradient NaN there
    (a tendon's stiffness trained from 0, say). The rule adds each tendon's spring and damper force times its
    Jacobian row to ``qfrc_spring`` / ``qfrc_damper`` without the branches, as the kernel's formulas otherwise (the
    damping with its actuators', times gear squared; a plastic tendon's range from ``plastic``)."""
    import numpy as np
    from mujoco_warp._src import passive

    if not m.ntendon:
        return []
    _, columns = _tendon_products(m)
    plasticadr = np.asarray(m.tendon_plasticadr.numpy())
    on_tendon = _actuators_on(m, tendons=True)

    def rule(before, after):
        length, velocity = before["ten_length_in"], before["ten_velocity_in"]
        nworld = length.shape[0]
        world = lambda name: _per_world(before[name], nworld)  # noqa: E731
        gear = world("actuator_gear")
        spring_range = world("tendon_lengthspring")
        if (plasticadr >= 0).any():
            plastic = before["plastic_in"][:, np.maximum(plasticadr, 0)[:, None] + np.arange(2)]
            spring_range = jnp.where((plasticadr >= 0)[:, None], plastic, spring_range)
        lower, upper = spring_range[..., 0], spring_range[..., 1]
        x = jnp.where(length > upper, length - upper, jnp.where(length < lower, length - lower, 0.0))
        spring = -x * _poly_force(world("tendon_stiffness"), world("tendon_stiffnesspoly"), x)
        damping = _plus_actuators(world("tendon_damping"), world("actuator_damping"), gear, on_tendon)
        dpoly = _plus_actuators(world("tendon_dampingpoly"), world("actuator_dampingpoly"), gear, on_tendon)
        damper = -velocity * _poly_force(damping, dpoly, velocity, odd=True)
        out = {}
        for name, force, off in (("qfrc_spring_out", spring, after["dsbl_spring"]),
                                 ("qfrc_damper_out", damper, after["dsbl_damper"])):
            out[name] = jnp.where(off, before[name], before[name] + columns(before["ten_J_in"], force))
        return out

    floats = ("tendon_stiffness", "tendon_stiffnesspoly", "tendon_damping", "tendon_dampingpoly",
              "tendon_lengthspring", "actuator_damping", "actuator_dampingpoly", "actuator_gear", "plastic_in",
              "ten_J_in", "ten_length_in", "ten_velocity_in", "qfrc_spring_out", "qfrc_damper_out")
    return [warpnn.StageRule(
        passive, "_spring_damper_tendon_passive", rule, per_launch=True,
        reads=lambda **a: {n: a[n] for n in floats},
        writes=lambda **a: {n: a[n] for n in ("qfrc_spring_out", "qfrc_damper_out")},
    )]


def _make_frame(n):
    """mujoco_warp's ``math.make_frame``: rows ``n``, then two unit vectors orthogonal to it (``(..., 3, 3)``)."""
    a = n / jnp.linalg.norm(n, axis=-1, keepdims=True)
    up = (-0.5 < a[..., 1]) & (a[..., 1] < 0.5)
    b = jnp.where(up[..., None], jnp.array([0.0, 1.0, 0.0], a.dtype), jnp.array([0.0, 0.0, 1.0], a.dtype))
    b = b - a * jnp.sum(a * b, axis=-1, keepdims=True)
    b = b / jnp.linalg.norm(b, axis=-1, keepdims=True)
    return jnp.stack([a, b, jnp.cross(a, b)], axis=-2)


def _safe_divide(x, y, ok):
    """``x / y`` where ``ok``, else 0, with no NaN in the derivative of the branch not taken."""
    return jnp.where(ok, x / jnp.where(ok, y, 1.0), 0.0)


def _sphere_sphere(p1, r1, p2, r2):
    """mujoco_warp's ``sphere_sphere``: distance between the surfaces, contact position, normal (from 1 to 2)."""
    gap = p2 - p1
    length = _safe_norm(gap)
    normal = jnp.where(length == 0, jnp.array([1.0, 0.0, 0.0], gap.dtype), _safe_divide(gap, length, length > 0))
    dist = length[..., 0] - (r1 + r2)
    return dist, p1 + normal * (r1 + 0.5 * dist)[:, None], normal


def _plane_capsule_frame(n, axis):
    """mujoco_warp's ``plane_capsule`` contact frame: rows ``n``, the capsule axis in the plane, their cross."""
    b = axis - n * jnp.sum(n * axis, -1, keepdims=True)
    norm = _safe_norm(b)
    b = _safe_divide(b, norm, norm > 0)
    up = (-0.5 < n[:, 1:2]) & (n[:, 1:2] < 0.5)
    b = jnp.where(norm < 0.5, jnp.where(up, jnp.array([0.0, 1.0, 0.0], n.dtype), jnp.array([0.0, 0.0, 1.0], n.dtype)),
                  b)
    return jnp.stack([n, b, jnp.cross(n, b)], axis=-2)


def _segment_weights(a, b, c, d, pair):
    """mujoco_warp's ``_segment_weights`` (MuJoCo's ``mjc_segWeights``): weights ``(s, t)`` of the closest points
    ``a + s (b - a)`` and ``c + t (d - c)``, and whether there are two such pairs (parallel segments); ``pair`` 1 is
    the second pair. Each branch as the kernel takes it, divisions guarded so the branches not taken leave no NaN
    in the derivative."""
    from mujoco_warp._src.types import MJ_MINVAL

    ab, cd, ca = b - a, d - c, a - c
    dot = lambda u, v: jnp.sum(u * v, -1)  # noqa: E731
    dot1, dot2, dot3, dot4, dot5 = dot(ab, ab), dot(cd, cd), dot(cd, ca), dot(ab, ca), dot(ab, cd)
    point1, point2 = dot1 <= MJ_MINVAL, dot2 <= MJ_MINVAL
    s0, s1 = _safe_divide(-dot4, dot1, ~point1), _safe_divide(dot5 - dot4, dot1, ~point1)

    def clamped(s, t):  # _clamp_segment_weights
        return (jnp.where(t < 0, jnp.clip(s0, 0, 1), jnp.where(t > 1, jnp.clip(s1, 0, 1), s)),
                jnp.where(t < 0, 0.0, jnp.where(t > 1, 1.0, t)))

    cross = jnp.cross(ab, cd)
    det = dot(cross, cross)
    crossing = det > 1.0e-8 * dot1 * dot2
    s = jnp.clip(_safe_divide(dot(cross, jnp.cross(cd, ca)), det, crossing), 0, 1)
    crossing_w = clamped(s, _safe_divide(dot5 * s + dot3, dot2, ~point2))
    first = clamped(jnp.zeros_like(dot1), _safe_divide(dot3, dot2, ~point2))
    second = clamped(jnp.ones_like(dot1), _safe_divide(dot5 + dot3, dot2, ~point2))
    zero = jnp.zeros_like(dot1)
    weights = []
    for k in range(2):
        w = jnp.where(pair == 1, second[k], jnp.where(crossing, crossing_w[k], first[k]))
        w = jnp.where(point1 & point2, zero, jnp.where(
            point1, (zero, jnp.clip(_safe_divide(dot3, dot2, ~point2), 0, 1))[k],
            jnp.where(point2, (jnp.clip(_safe_divide(-dot4, dot1, ~point1), 0, 1), zero)[k], w)))
        weights.append(w[:, None])
    return weights[0], weights[1], ~point1 & ~point2 & ~crossing


# The primitive collisions of mujoco_warp's narrowphase (collision_primitive_core), in JAX, one function per geom
# pair: each takes the two geoms' positions, orientations and sizes per contact slot, the collision id the launch
# left in the slot (which of a pair's contacts it is) and ``launch``, what else the launch had and wrote for the slot
# (not differentiated: ``band``, the pair's margin + gap, which decides which of two boxes' clipped corners are
# contacts; ``dist`` and ``pos``, the contact it wrote, whose mesh vertex a plane-mesh contact is), and gives the
# contact's distance, position and frame. Every
# branch of the Warp function is computed and selected by its condition, divisions guarded, so that the branches
# not taken leave no NaN in the derivative.

def _plane_sphere_point(normal, plane_pos, centre, radius):
    """mujoco_warp's ``plane_sphere``: a sphere's distance from a plane and the contact point midway."""
    dist = jnp.sum((centre - plane_pos) * normal, -1) - radius
    return dist, centre - normal * (radius + 0.5 * dist)[:, None]


def _plane_sphere(plane_pos, plane_rot, _, pos, __, size, ___, _launch):
    normal = plane_rot[:, :, 2]
    return *_plane_sphere_point(normal, plane_pos, pos, size[:, 0]), _make_frame(normal)


def _plane_capsule(plane_pos, plane_rot, _, pos, rot, size, cid, _launch):
    normal, axis = plane_rot[:, :, 2], rot[:, :, 2]
    end = pos + jnp.where(cid == 0, 1.0, -1.0)[:, None] * axis * size[:, 1:2]  # contact 0 at +axis
    return *_plane_sphere_point(normal, plane_pos, end, size[:, 0]), _plane_capsule_frame(normal, axis)


def _plane_ellipsoid(plane_pos, plane_rot, _, pos, rot, size, __, _launch):
    normal = plane_rot[:, :, 2]
    scaled = _matvec_transposed(rot, normal) * size  # (the plane's normal in the ellipsoid's frame, scaled)
    length = _safe_norm(scaled)
    deepest = pos + _matvec(rot, -_safe_divide(scaled, length, length > 0) * size)
    dist = jnp.sum(normal * (deepest - plane_pos), -1)
    return dist, deepest - normal * 0.5 * dist[:, None], _make_frame(normal)


def _plane_cylinder(plane_pos, plane_rot, _, pos, rot, size, cid, _launch):
    """Four contacts: the rim's point nearest the plane on each cap (ids 0, 1), two more on the near cap (2, 3)."""
    normal, radius, half = plane_rot[:, :, 2], size[:, 0:1], size[:, 1:2]
    along = jnp.sum(normal * rot[:, :, 2], -1, keepdims=True)
    axis = jnp.where(along > 0, -rot[:, :, 2], rot[:, :, 2])  # (towards the plane)
    along = -jnp.abs(along)
    centre = jnp.sum((pos - plane_pos) * normal, -1, keepdims=True)
    rim = axis * along - normal
    squared = jnp.sum(rim * rim, -1, keepdims=True)
    tilted = squared >= 1e-12
    rim = jnp.where(tilted, rim * radius / jnp.sqrt(jnp.where(tilted, squared, 1.0)),
                    jnp.array([1.0, 0.0, 0.0], pos.dtype) * radius)
    rim_down = jnp.sum(rim * normal, -1, keepdims=True)
    axis, along = axis * half, along * half
    side = jnp.cross(rim, axis)
    side_length = _safe_norm(side)
    side = _safe_divide(side, side_length, side_length > 0) * radius * (3.0**0.5 * 0.5)
    near, far, third = centre + along + rim_down, centre - along + rim_down, centre + along - 0.5 * rim_down
    dists = [near, far, third, third]
    points = [pos + rim + axis, pos + rim - axis, pos + side + axis - 0.5 * rim, pos - side + axis - 0.5 * rim]
    dist = sum(jnp.where(cid[:, None] == k, d, 0.0) for k, d in enumerate(dists))
    point = sum(jnp.where(cid[:, None] == k, p, 0.0) for k, p in enumerate(points))
    return dist[:, 0], point - normal * 0.5 * dist, _make_frame(normal)


def _plane_box(plane_pos, plane_rot, _, pos, rot, size, cid, _launch):
    """The corner the collision id names (bit k: + or - the half-size along the box's axis k)."""
    normal = plane_rot[:, :, 2]
    bits = (cid[:, None] >> jnp.arange(3)) & 1
    corner = _matvec(rot, jnp.where(bits == 1, 1.0, -1.0) * size)
    dist = jnp.sum((pos - plane_pos) * normal, -1) + jnp.sum(normal * corner, -1)
    return dist, corner + pos - 0.5 * normal * dist[:, None], _make_frame(normal)


def _sphere_sphere_contact(pos1, _, size1, pos2, __, size2, ___, _launch):
    dist, pos, normal = _sphere_sphere(pos1, size1[:, 0], pos2, size2[:, 0])
    return dist, pos, _make_frame(normal)


def _sphere_capsule(pos1, _, size1, pos2, rot2, size2, __, _launch):
    axis = rot2[:, :, 2]
    along = jnp.clip(jnp.sum(axis * (pos1 - pos2), -1, keepdims=True), -size2[:, 1:2], size2[:, 1:2])
    dist, pos, normal = _sphere_sphere(pos1, size1[:, 0], pos2 + axis * along, size2[:, 0])
    return dist, pos, _make_frame(normal)


def _sphere_cylinder(pos1, _, size1, pos2, rot2, size2, __, _launch):
    """The cylinder's side, a cap or the rim, whichever the sphere's centre is nearest (as the kernel decides)."""
    axis, radius, half = rot2[:, :, 2], size2[:, 0], size2[:, 1]
    offset = pos1 - pos2
    x = jnp.sum(offset * axis, -1)
    out = offset - axis * x[:, None]  # (away from the axis)
    squared = jnp.sum(out * out, -1)
    side, cap = jnp.abs(x) < half, squared < radius * radius
    cap_nearer = half - jnp.abs(x) < radius - jnp.sqrt(jnp.where(side & cap, squared, 0.0))
    side, cap = side & ~(cap & cap_nearer), cap & ~(side & ~cap_nearer)
    side_dist, side_pos, side_normal = _sphere_sphere(pos1, size1[:, 0], pos2 + axis * x[:, None], radius)
    up = jnp.where(x > 0, 1.0, -1.0)[:, None] * axis  # (the cap's outward normal)
    cap_dist, cap_pos = _plane_sphere_point(up, pos2 + up * half[:, None], pos1, size1[:, 0])
    scale = _safe_divide(radius, jnp.sqrt(jnp.where(squared > 0, squared, 1.0)), squared > 0)  # (0: on the axis)
    rim = pos2 + jnp.where(x < 0, -1.0, 1.0)[:, None] * axis * half[:, None] + out * scale[:, None]
    rim_dist, rim_pos, rim_normal = _sphere_sphere(pos1, size1[:, 0], rim, jnp.zeros_like(radius))
    dist = jnp.where(side, side_dist, jnp.where(cap, cap_dist, rim_dist))
    pos = jnp.where(side[:, None], side_pos, jnp.where(cap[:, None], cap_pos, rim_pos))
    normal = jnp.where(side[:, None], side_normal, jnp.where(cap[:, None], -up, rim_normal))
    return dist, pos, _make_frame(normal)


def _sphere_box(pos1, _, size1, pos2, rot2, size2, __, _launch):
    """Outside the box: towards its nearest point; inside: out through its nearest face."""
    from mujoco_warp._src.types import MJ_MINVAL

    radius = size1[:, 0:1]
    centre = _matvec_transposed(rot2, pos1 - pos2)  # (in the box's frame)
    clamped = jnp.clip(centre, -size2, size2)
    length = _safe_norm(clamped - centre)
    towards = _safe_divide(clamped - centre, length, length > 0)
    outside_pos = 0.5 * (clamped + centre + towards * radius)
    faces = jnp.abs(jnp.stack([sign * size2[:, k] - centre[:, k] for k in range(3) for sign in (-1.0, 1.0)], -1))
    face = jnp.argmin(faces, -1)  # (the first of equals, as the kernel's strict comparison keeps)
    nearest = jax.nn.one_hot(face // 2, 3, dtype=pos1.dtype) * jnp.where(face % 2 == 1, -1.0, 1.0)[:, None]
    depth = jnp.take_along_axis(faces, face[:, None], -1)
    inside = (length <= MJ_MINVAL)
    local_pos = jnp.where(inside, centre + nearest * 0.5 * (radius - depth), outside_pos)
    dist = jnp.where(inside, -depth - radius, length - radius)[:, 0]
    normal = _matvec(rot2, jnp.where(inside, nearest, towards))
    return dist, pos2 + _matvec(rot2, local_pos), _make_frame(normal)


def _capsule_capsule(pos1, rot1, size1, pos2, rot2, size2, cid, _launch):
    """The closest points of the two axes (``cid`` 1: the second pair of parallel capsules; where the axes are not
    parallel the kernel makes no second contact: distance infinite, position and frame zero, which a geom-distance
    sensor's pair writes)."""
    axis1, axis2 = rot1[:, :, 2], rot2[:, :, 2]
    half1, half2 = size1[:, 1:2], size2[:, 1:2]
    s, t, parallel = _segment_weights(pos1 - axis1 * half1, pos1 + axis1 * half1, pos2 - axis2 * half2,
                                      pos2 + axis2 * half2, cid)
    dist, pos, normal = _sphere_sphere(pos1 + axis1 * half1 * (2 * s - 1), size1[:, 0],
                                       pos2 + axis2 * half2 * (2 * t - 1), size2[:, 0])
    return _made_only((cid != 1) | parallel, dist, pos, _make_frame(normal), jnp.inf)


def _made_only(made, dist, pos, frame, unmade_dist):
    """A slot's contact where the collision function ``made`` it; elsewhere what the kernel writes for a candidate
    it did not make (a geom-distance sensor's pair writes those): ``unmade_dist``, a zero position and frame."""
    return (jnp.where(made, dist, unmade_dist), jnp.where(made[:, None], pos, 0.0),
            jnp.where(made[:, None, None], frame, 0.0))


def _mj_safe_div(x, y):
    """mujoco_warp's ``math.safe_div``: ``x / y``, dividing by ``MJ_MINVAL`` where ``y`` is 0."""
    from mujoco_warp._src.types import MJ_MINVAL

    return x / jnp.where(y != 0.0, y, MJ_MINVAL)


def _at(x, k):
    """``x[slot, k[slot]]`` for ``x`` of shape (slots, 3): each slot's component ``k`` (an axis index the
    collision functions compute per slot; kept in 0..2, where a slot's unused branch leaves it anything)."""
    return jnp.take_along_axis(x, jnp.clip(k, 0, 2)[:, None], 1)[:, 0]


def _column(R, k):
    """``R[slot, :, k[slot]]`` for ``R`` of shape (slots, 3, 3): each slot's column ``k`` (kept in 0..2, as
    :func:`_at`)."""
    return jnp.take_along_axis(R, jnp.clip(k, 0, 2)[:, None, None], 2)[:, :, 0]


def _capsule_box_segment(p, axis, half, size):
    """Where ``capsule_box`` puts its spheres along the capsule (in the box's frame: centre ``p``, unit axis
    ``axis``, half length ``half``; the box's half-extents ``size``): the first sphere at ``p + h * first`` (``h =
    axis * half``), the second at ``p + h * (first + second)`` where ``second > -3`` (else there is none), and
    whether there is any contact (``cltype != -4``). The kernel's
    searches as it runs them: its two capsule ends against the box's faces, then its twelve edges in order, each
    replacing the best only if strictly nearer; then the second point by the configuration found (a corner, an
    edge or a face nearest)."""
    from mujoco_warp._src.types import MJ_MINVAL

    i32 = jnp.int32
    count, dtype = p.shape[0], p.dtype
    h = axis * half[:, None]
    axisdir = sum((h[:, k] > 0).astype(i32) << k for k in range(3))
    best = jnp.full(count, 1.0e32, dtype)
    first, box_at = jnp.full(count, -12.0, dtype), jnp.zeros(count, dtype)
    cltype, clface = jnp.full(count, -4, i32), jnp.full(count, -12, i32)
    clcorner, cledge = jnp.full(count, -123, i32), jnp.full(count, -123, i32)
    for end in (-1, 1):  # a capsule end nearest a face: its tip clamped into the box, past at most one face
        tip = p + end * h
        past = (tip < -size) | (tip > size)
        dist = jnp.sum((jnp.clip(tip, -size, size) - tip) ** 2, -1)
        better = (jnp.sum(past, -1) <= 1) & (dist < best)
        best, first = jnp.where(better, dist, best), jnp.where(better, float(end), first)
        cltype = jnp.where(better, -2 + end, cltype)
        clface = jnp.where(better, jnp.max(jnp.where(past, jnp.arange(3), -1), -1), clface)
    for corner in range(8):  # the edge from each corner along each axis the corner's bits leave 0
        for j in range(3):
            if corner & (1 << j):
                continue
            signs = jnp.array([1.0 if corner & (1 << k) else -1.0 for k in range(3)], dtype)
            dif = (signs * size).at[:, j].set(0.0) - p
            u, v = -size[:, j] * dif[:, j], jnp.sum(h * dif, -1)
            ma, mb, mc = size[:, j] ** 2, -size[:, j] * h[:, j], half**2
            det = ma * mc - mb * mb
            solvable = jnp.abs(det) >= MJ_MINVAL
            x1, x2 = _safe_divide(mc * u - mb * v, det, solvable), _safe_divide(ma * v - mb * u, det, solvable)
            high, low = x1 > 1, x1 < -1
            s1 = jnp.where(high, 2, jnp.where(low, 0, 1))
            x2 = jnp.where(high, _mj_safe_div(v - mb, mc), jnp.where(low, _mj_safe_div(v + mb, mc), x2))
            x1 = jnp.clip(x1, -1.0, 1.0)
            high, low = x2 > 1, x2 < -1
            s2 = jnp.where(high, 2, jnp.where(low, 0, 1))
            x1 = jnp.where(high, _mj_safe_div(u - mb, ma), jnp.where(low, _mj_safe_div(u + mb, ma), x1))
            s1 = jnp.where(high | low, jnp.where(x1 > 1, 2, jnp.where(x1 < -1, 0, s1)), s1)
            x1, x2 = jnp.where(high | low, jnp.clip(x1, -1.0, 1.0), x1), jnp.clip(x2, -1.0, 1.0)
            dif = (dif - h * x2[:, None]).at[:, j].add(size[:, j] * x1)
            kind = s1 * 3 + s2
            dist = jnp.sum(dif * dif, -1)
            better = solvable & (dist < best - MJ_MINVAL)
            best, first, box_at = (jnp.where(better, a, b) for a, b in ((dist, best), (x2, first), (x1, box_at)))
            clcorner = jnp.where(better, corner + (1 << j) * (kind // 6), clcorner)
            cledge, cltype = jnp.where(better, j, cledge), jnp.where(better, kind, cltype)

    def room(k):  # safe_div(size[k], |h[k]|)
        return _mj_safe_div(_at(size, k), jnp.abs(_at(h, k)))

    # a corner nearest: a second point unless the capsule points along the corner's diagonal
    c1 = axisdir ^ clcorner
    single = (c1 == 1) | (c1 == 2) | (c1 == 4)
    mul = jnp.where(single, 1.0, -1.0)
    ax = jnp.where(single, c1, 7 - c1)
    ax = jnp.where(ax == 1, 0, jnp.where(ax == 2, 1, 2))
    on_corner = jnp.where(_at(axis, ax) ** 2 > 0.5,
                          jnp.minimum(1.0 - mul * first, 2.0 * room(ax)),
                          -jnp.minimum(1.0 + mul * first, 2.0 * jnp.minimum(room((ax + 1) % 3), room((ax + 2) % 3))))
    on_corner = jnp.where((c1 != 0) & (c1 != 7), on_corner * mul, -4.0)
    # an edge nearest: a second point in the X configuration
    edge = jnp.clip(cledge, 0, 2)
    c1 = (axisdir ^ clcorner) & (7 - (1 << edge))
    ax1, ax2 = (edge + 1) % 3, (edge + 2) % 3
    ax1 = jnp.where(jnp.abs(_at(axis, ax1)) > jnp.abs(_at(axis, ax2)), ax2, ax1)
    ax2 = 3 - edge - ax1
    towards = (c1 & (1 << ax2)) != 0
    mul = jnp.where(towards, 1.0, -1.0)
    on_edge = jnp.minimum(2.0 * room(ax2), jnp.where(towards, 1.0 - first, 1.0 + first))
    along = jnp.where(((axisdir & (1 << edge)) != 0) == towards, 1.0 - box_at, 1.0 + box_at)
    on_edge = jnp.minimum(_at(size, edge) * _mj_safe_div(along, jnp.abs(_at(h, edge))), on_edge)
    on_edge = jnp.where((c1 == 1) | (c1 == 2) | (c1 == 4), on_edge * mul, -4.0)
    # a face nearest: the farthest point of the capsule still over the box
    mul = jnp.where(cltype == -3, 1.0, -1.0)
    far = p - h * mul[:, None]
    on_face = jnp.full(count, 2.0, dtype)
    for k in range(3):
        for bound in (size[:, k], -size[:, k]):
            e1 = (bound - far[:, k]) * _mj_safe_div(mul, h[:, k])
            on_face = jnp.where((clface != k) & (0 < e1) & (e1 < on_face), e1, on_face)
    on_face = jnp.where(clface != -1, on_face * mul, -4.0)
    second = jnp.where(cltype >= 0, jnp.where(cltype // 3 != 1, on_corner, on_edge), on_face)
    return first, second, cltype != -4


def _capsule_box(pos1, rot1, size1, pos2, rot2, size2, cid, _launch):
    """Two spheres of the capsule's radius on its axis, each against the box as ``sphere_box`` (``cid`` 1: the
    second, where ``capsule_box`` makes one). A contact the kernel does not make has distance ``MJ_MAXVAL`` and a
    zero position and frame (a geom-distance sensor's pair writes it, and reads its distance)."""
    from mujoco_warp._src.types import MJ_MAXVAL

    p, axis = _matvec_transposed(rot2, pos1 - pos2), _matvec_transposed(rot2, rot1[:, :, 2])
    first, second, any_contact = _capsule_box_segment(p, axis, size1[:, 1], size2)
    h = axis * size1[:, 1:2]
    twice = cid == 1
    centre = pos2 + _matvec(rot2, p + h * (first + jnp.where(twice, second, 0.0))[:, None])
    dist, pos, frame = _sphere_box(centre, None, size1, pos2, rot2, size2, cid, _launch)
    return _made_only(any_contact & ~(twice & (second <= -3)), dist, pos, frame, MJ_MAXVAL)


def _box_box_axis(rot, pos21, pos12, size1, size2, septol):
    """``box_box``'s separating-axis search: whether an axis separates the boxes by more than ``septol``; ``code``
    (0-2 a face of box 1, 3-5 of box 2, ``6 + 3 i + j`` the edges ``i`` of box 1 and ``j`` of box 2), in the
    kernel's order and with its tie rules and preference of a face over an edge nearly parallel to it; and the edge
    axis (box 1's frame, unit) where an edge pair wins."""
    from mujoco_warp._src.collision_primitive_core import _BOXBOX_EDGEBIAS, _BOXBOX_PAREPS
    from mujoco_warp._src.types import MJ_MAXVAL, MJ_MINVAL

    count = rot.shape[0]
    best, code = jnp.full(count, -MJ_MAXVAL, rot.dtype), jnp.full(count, -1, jnp.int32)
    separated = jnp.zeros(count, bool)
    for k in range(6):
        if k < 3:
            sep = jnp.abs(pos21[:, k]) - size1[:, k] - jnp.sum(jnp.abs(rot[:, k, :]) * size2, -1)
        else:
            sep = jnp.abs(pos12[:, k - 3]) - size2[:, k - 3] - jnp.sum(jnp.abs(rot[:, :, k - 3]) * size1, -1)
        better = sep > best
        best, code, separated = jnp.where(better, sep, best), jnp.where(better, k, code), separated | (sep > septol)
    face_sep, face_code = best, code
    for i in range(3):
        i1, i2 = (i + 1) % 3, (i + 2) % 3
        for j in range(3):
            j1, j2 = (j + 1) % 3, (j + 2) % 3
            ax1, ax2 = -rot[:, i2, j], rot[:, i1, j]
            norm2 = ax1 * ax1 + ax2 * ax2
            usable = norm2 >= _BOXBOX_PAREPS
            inverse = jnp.where(usable, jax.lax.rsqrt(jnp.where(usable, norm2, 1.0)), 0.0)
            ax1, ax2 = ax1 * inverse, ax2 * inverse
            radius1 = size1[:, i1] * jnp.abs(ax1) + size1[:, i2] * jnp.abs(ax2)
            radius2 = (size2[:, j1] * jnp.abs(ax1 * rot[:, i1, j1] + ax2 * rot[:, i2, j1])
                       + size2[:, j2] * jnp.abs(ax1 * rot[:, i1, j2] + ax2 * rot[:, i2, j2]))
            sep = jnp.abs(ax1 * pos21[:, i1] + ax2 * pos21[:, i2]) - radius1 - radius2
            separated |= usable & (sep > septol)
            better = usable & (sep - _BOXBOX_EDGEBIAS * jnp.abs(sep) > best) & (sep > face_sep)
            best, code = jnp.where(better, sep, best), jnp.where(better, 6 + 3 * i + j, code)
    edge_i, edge_j = jnp.clip(code - 6, 0, 8) // 3, jnp.clip(code - 6, 0, 8) % 3
    i1, i2 = (edge_i + 1) % 3, (edge_i + 2) % 3
    column = _column(rot, edge_j)  # (box 2's edge axis in box 1's frame)
    axis = (jax.nn.one_hot(i1, 3, dtype=rot.dtype) * -jnp.take_along_axis(column, i2[:, None], 1)
            + jax.nn.one_hot(i2, 3, dtype=rot.dtype) * jnp.take_along_axis(column, i1[:, None], 1))
    axis = axis / _safe_norm(jnp.where((code >= 6)[:, None], axis, 1.0))  # (a face's: unused, kept finite)
    face_rot = _column(rot, face_code - 3)
    face_axis = jnp.take_along_axis(axis, jnp.clip(face_code, 0, 2)[:, None], 1)[:, 0]
    face_dot = jnp.abs(jnp.where(face_code < 3, face_axis, jnp.sum(axis * face_rot, -1)))
    aliased = (code >= 6) & (face_dot > 0.99) & (best < face_sep + 0.05 * jnp.abs(face_sep) + MJ_MINVAL)
    return separated, jnp.where(aliased, face_code, code), axis


def _box_box_edges(rot, pos21, size1, size2, code, axis):
    """``box_box``'s edge-edge contact: the witness points of the two supporting edges (both choices of a corner
    the axis leaves ambiguous, the nearer pair kept), in box 1's frame."""
    from mujoco_warp._src.collision_primitive_core import _BOXBOX_SGNEPS
    from mujoco_warp._src.types import MJ_MAXVAL, MJ_MINVAL

    dtype = rot.dtype
    edge_i, edge_j = jnp.clip(code - 6, 0, 8) // 3, jnp.clip(code - 6, 0, 8) % 3
    i1, i2, j1, j2 = (edge_i + 1) % 3, (edge_i + 2) % 3, (edge_j + 1) % 3, (edge_j + 2) % 3
    axis = jnp.where((jnp.sum(axis * pos21, -1) < 0.0)[:, None], -axis, axis)
    a2 = _matvec_transposed(rot, axis)  # (the axis in box 2's frame)

    def ambiguous(direction, k1, k2):  # the first of the two components too small to choose a corner by, or -1
        small = lambda k: jnp.abs(_at(direction, k)) < _BOXBOX_SGNEPS  # noqa: E731
        return jnp.where(small(k1), k1, jnp.where(small(k2), k2, -1))

    amb1, amb2 = ambiguous(axis, i1, i2), ambiguous(a2, j1, j2)
    d2 = _column(rot, edge_j)
    b = _at(d2, edge_i)
    denom = 1.0 - b * b
    on_i, on_j = jax.nn.one_hot(edge_i, 3, dtype=dtype), jax.nn.one_hot(edge_j, 3, dtype=dtype)
    best = jnp.full(rot.shape[0], MJ_MAXVAL, dtype)
    w1 = w2 = jnp.zeros_like(axis)
    for v1 in (0, 1):
        for v2 in (0, 1):
            flip1 = jax.nn.one_hot(amb1, 3, dtype=dtype) * float(v1)  # (one_hot of -1: no component)
            flip2 = jax.nn.one_hot(amb2, 3, dtype=dtype) * float(v2)
            c1 = jnp.where(axis >= 0.0, size1, -size1) * (1.0 - on_i) * (1.0 - 2.0 * flip1)
            cc = jnp.where(a2 >= 0.0, -size2, size2) * (1.0 - on_j) * (1.0 - 2.0 * flip2)
            c2 = _matvec(rot, cc) + pos21
            e = c2 - c1
            d1e, d2e = _at(e, edge_i), jnp.sum(d2 * e, -1)
            s = _safe_divide(d1e - b * d2e, denom, denom >= MJ_MINVAL)
            half1, half2 = _at(size1, edge_i), _at(size2, edge_j)
            s = jnp.clip(s, -half1, half1)
            t = jnp.clip(b * s - d2e, -half2, half2)
            s = jnp.clip(d1e + b * t, -half1, half1)
            p1 = c1 * (1.0 - on_i) + on_i * s[:, None]
            p2 = c2 + d2 * t[:, None]
            gap2 = jnp.sum((p2 - p1) ** 2, -1)
            better = ((v1 == 0) | (amb1 >= 0)) & ((v2 == 0) | (amb2 >= 0)) & (gap2 < best)
            best = jnp.where(better, gap2, best)
            w1, w2 = jnp.where(better[:, None], p1, w1), jnp.where(better[:, None], p2, w2)
    return w1, w2, axis


def _box_box_clip(count, poly, coord, sign, limit):
    """``_box_box_clip``: the polygon's first ``count`` of 8 vertices clipped to ``sign * v[coord] <= limit``,
    vertices emitted in the kernel's order (each inside one, then where an edge crosses), at most 8; an all-inside
    polygon unchanged."""
    index = jnp.arange(8)
    valid = index < count[:, None]
    d = sign * poly[:, :, coord] - limit[:, None]
    inside = d <= 0.0
    after = jnp.where(index + 1 >= count[:, None], 0, index + 1)  # (the first after the last; in range past it)
    q, dq = jnp.take_along_axis(poly, after[:, :, None], 1), jnp.take_along_axis(d, after, 1)
    crosses = valid & (((d < 0.0) & (dq > 0.0)) | ((d > 0.0) & (dq < 0.0)))
    t = _safe_divide(d, d - dq, crosses)
    candidates = jnp.stack([poly, poly + t[:, :, None] * (q - poly)], 2).reshape(poly.shape[0], 16, 3)
    emitted = jnp.stack([valid & inside, crosses], 2).reshape(poly.shape[0], 16)
    slot = jnp.cumsum(emitted, 1) - 1
    emitted &= slot < 8
    placed = jax.nn.one_hot(jnp.where(emitted, slot, -1), 8, dtype=poly.dtype)  # (candidate, vertex)
    clipped = jnp.einsum("scv,scd->svd", placed, candidates)
    unchanged = jnp.all(inside | ~valid, 1)
    return jnp.where(unchanged, count, jnp.sum(emitted, 1)), jnp.where(unchanged[:, None, None], poly, clipped)


def _box_box_faces(rot, pos21, pos12, rot1, pos1, rot2, pos2, size1, size2, code, cid, band):
    """``box_box``'s face contact: the incident face clipped to the reference face's sides; contact ``cid`` is
    the ``cid``-th clipped vertex within the band, near-duplicates dropped, as the kernel numbers them."""
    from mujoco_warp._src.collision_primitive_core import _BOXBOX_DUPEPS
    from mujoco_warp._src.types import MJ_MAXVAL

    count, dtype = rot.shape[0], rot.dtype
    ref1 = code < 3
    a = jnp.clip(jnp.where(ref1, code, code - 3), 0, 2)
    sizeref, sizeinc = jnp.where(ref1[:, None], size1, size2), jnp.where(ref1[:, None], size2, size1)
    posref, matref = jnp.where(ref1[:, None], pos1, pos2), jnp.where(ref1[:, None, None], rot1, rot2)
    posoi = jnp.where(ref1[:, None], pos21, pos12)
    rinc = jnp.where(ref1[:, None, None], rot, jnp.swapaxes(rot, 1, 2))
    sgn = jnp.where(_at(posoi, a) >= 0.0, 1.0, -1.0)
    row = jnp.take_along_axis(rinc, a[:, None, None], 1)[:, 0, :]  # rinc[a, :]
    binc = jnp.argmax(jnp.abs(row), -1)  # (the first of equals, as the kernel's strict comparison keeps)
    tinc = jnp.where(sgn * _at(row, binc) > 0.0, -1.0, 1.0)
    ax, ay, bu, bv = (a + 1) % 3, (a + 2) % 3, (binc + 1) % 3, (binc + 2) % 3
    coords = jnp.stack([ax, ay, a], 1)
    gathered = lambda x: jnp.take_along_axis(x, coords, 1)  # noqa: E731  (x[coords[r]] per slot)
    cx = gathered(posoi + (tinc * _at(sizeinc, binc))[:, None] * _column(rinc, binc))
    du, dv = (gathered(_at(sizeinc, k)[:, None] * _column(rinc, k)) for k in (bu, bv))
    up = jnp.stack([jnp.ones_like(sgn), jnp.ones_like(sgn), sgn], 1)
    cx = cx * up - jnp.stack([jnp.zeros_like(sgn), jnp.zeros_like(sgn), _at(sizeref, a)], 1)
    du, dv = du * up, dv * up
    corners = [cx + su * du + sv * dv for su, sv in ((1.0, 1.0), (-1.0, 1.0), (-1.0, -1.0), (1.0, -1.0))]
    poly = jnp.concatenate([jnp.stack(corners, 1), jnp.zeros((count, 4, 3), dtype)], 1)
    n = jnp.full(count, 4, jnp.int32)
    for coord, sign, limit in ((0, 1.0, _at(sizeref, ax)), (0, -1.0, _at(sizeref, ax)), (1, 1.0, _at(sizeref, ay)),
                               (1, -1.0, _at(sizeref, ay))):
        n, poly = _box_box_clip(n, poly, coord, sign, limit)
    duplicate = _BOXBOX_DUPEPS * (_at(sizeref, ax) ** 2 + _at(sizeref, ay) ** 2)
    accepted, naccept = jnp.zeros_like(poly), jnp.zeros(count, jnp.int32)
    for k in range(8):
        v = poly[:, k]
        near = jnp.sum((accepted[:, :, :2] - v[:, None, :2]) ** 2, -1) < duplicate[:, None]
        take = (k < n) & ~(v[:, 2] > band) & ~jnp.any(near & (jnp.arange(8) < naccept[:, None]), 1)
        accepted = jnp.where((take[:, None] & (jnp.arange(8) == naccept[:, None]))[:, :, None], v[:, None], accepted)
        naccept = naccept + take
    v = jnp.take_along_axis(accepted, jnp.clip(cid, 0, 7)[:, None, None], 1)[:, 0]
    on = lambda k: jax.nn.one_hot(k, 3, dtype=dtype)  # noqa: E731
    local = (on(ax) * v[:, :1] + on(ay) * v[:, 1:2]
             + on(a) * (sgn * (_at(sizeref, a) + 0.5 * v[:, 2]))[:, None])
    normal = jnp.where(ref1, sgn, -sgn)[:, None] * _column(matref, a)
    dist = jnp.where(cid < naccept, v[:, 2], MJ_MAXVAL)
    return dist, _matvec(matref, local) + posref, normal


def _box_box(pos1, rot1, size1, pos2, rot2, size2, cid, launch):
    """Two boxes (MuJoCo's ``mjc_BoxBox`` as mujoco_warp ports it): the separating axis of least penetration; on
    an edge pair one contact midway between the edges' closest points, on a face the incident face's clipped
    corners within the band (contact ``cid``: the kernel's ``cid``-th). A contact the kernel does not make (or a
    pair it finds separated) has distance ``MJ_MAXVAL``. Its tolerances are mujoco_warp's own."""
    from mujoco_warp._src.collision_primitive_core import _BOXBOX_SEPEPS
    from mujoco_warp._src.types import MJ_MAXVAL

    band = launch["band"]
    pos21, pos12 = _matvec_transposed(rot1, pos2 - pos1), _matvec_transposed(rot2, pos1 - pos2)
    rot = jnp.einsum("sji,sjk->sik", rot1, rot2)  # (box 2's axes in box 1's frame: columns)
    septol = band + _BOXBOX_SEPEPS * (jnp.sum(size1, -1) + jnp.sum(size2, -1))
    separated, code, axis = _box_box_axis(rot, pos21, pos12, size1, size2, septol)
    w1, w2, axis = _box_box_edges(rot, pos21, size1, size2, code, axis)
    edge_dist = jnp.sum((w2 - w1) * axis, -1)
    edge_dist = jnp.where((cid == 0) & (edge_dist <= septol), edge_dist, MJ_MAXVAL)
    edge_pos, edge_normal = _matvec(rot1, 0.5 * (w1 + w2)) + pos1, _matvec(rot1, axis)
    face_dist, face_pos, face_normal = _box_box_faces(rot, pos21, pos12, rot1, pos1, rot2, pos2, size1, size2, code,
                                                      cid, band)
    edge = code >= 6
    normal = jnp.where(edge[:, None], edge_normal, face_normal)
    return (jnp.where(separated, MJ_MAXVAL, jnp.where(edge, edge_dist, face_dist)),
            jnp.where(edge[:, None], edge_pos, face_pos), _make_frame(normal))


def _plane_mesh(plane_pos, plane_rot, _, pos, rot, __, ___, launch):
    """A mesh vertex against the plane: every contact ``plane_convex`` writes is one (the support vertex, then the
    incident face's), at ``vertex - dist / 2 * normal``. Which vertex is the launch's choice (a hill climb over the
    mesh's graph, a face, its hull): read back from the contact it wrote, as the vertex's coordinates in the mesh's
    frame, which no pose or parameter moves; the contact then follows the pose differentiably."""
    normal = plane_rot[:, :, 2]
    vertex = launch["pos"] + 0.5 * launch["dist"][:, None] * normal
    local = jax.lax.stop_gradient(_matvec_transposed(rot, vertex - pos))
    return (*_plane_sphere_point(normal, plane_pos, pos + _matvec(rot, local), jnp.zeros_like(launch["dist"])),
            _make_frame(normal))


_PAIR_CONTACTS = {"plane-sphere": _plane_sphere, "plane-capsule": _plane_capsule, "plane-ellipsoid": _plane_ellipsoid,
                  "plane-cylinder": _plane_cylinder, "plane-box": _plane_box, "sphere-sphere": _sphere_sphere_contact,
                  "sphere-capsule": _sphere_capsule, "sphere-cylinder": _sphere_cylinder, "sphere-box": _sphere_box,
                  "capsule-capsule": _capsule_capsule, "capsule-box": _capsule_box, "box-box": _box_box,
                  "plane-mesh": _plane_mesh}


# How closely the narrowphase rule's contact (distance, position, frame) must equal the one the launch wrote, relative
# to its magnitude (at least 1), for the rule to differentiate it: float32 rounding stays under 1e-4 on mujoco_warp's
# functions' random poses (5e-4 for a frame whose normal is the direction of a vector 1e-3 long); another branch
# taken moves a contact by a geom's size or turns its frame.
CONTACT_AGREEMENT = 1e-3

# Up to this many subtree roots among the bodies contacts touch, the contact Jacobian rule takes each row's root's
# centre of mass by a select per root; beyond, by a gather (one select per root over every row would cost more).
ROOTS_BY_SELECTS = 8


def _root_centres_of_mass(subtree_com, root, roots, contact_row):
    """``subtree_com[world, root[world, row, geom]]``, (world, row, 2, 3): the centre of mass of each contact row's
    geoms' subtree roots (``roots``: every root contacts can have; rows where ``contact_row`` is false are not a
    contact's and are masked out by the caller). Up to ``ROOTS_BY_SELECTS`` roots by a select per root, whose
    reverse sums; beyond, by a gather whose reverse scatter-adds, with the rows that are not a contact's reading
    roots spread over the bodies (in reverse, their zero cotangents then add into different elements)."""
    if roots.size <= ROOTS_BY_SELECTS:
        return sum((jnp.where((root == r)[..., None], subtree_com[:, None, None, r], 0.0) for r in roots),
                   jnp.zeros((*root.shape, 3), subtree_com.dtype))
    world = jnp.arange(root.shape[0])[:, None, None]
    rows = jnp.arange(root.shape[1])[None, :, None]
    return subtree_com[world, jnp.where(contact_row[..., None], root, rows % subtree_com.shape[1])]


def _contact_rules(m) -> list:
    """The collision stages, differentiated by rules (``warpnn.StageRule(per_launch=True)``).

    * ``collision_primitive._primitive_narrowphase``: writes each contact at a slot ``wp.atomic_add`` hands out
      (inside ``write_contact``), through a table of collision functions, which no per-kernel adjoint gets right.
      Rule: the contact's distance, position and frame recomputed in JAX from ``geom_xpos`` / ``geom_xmat`` (and
      ``geom_size``) for the pair and the collision id the launch left in each written slot (the box's corner, the
      capsule's end, the second pair of parallel capsules), as mujoco_warp's collision functions compute them
      (``_PAIR_CONTACTS``: a plane against spheres, capsules, ellipsoids, cylinders and boxes, a sphere against
      spheres, capsules, cylinders and boxes, a capsule against capsules and boxes, box-box, and a plane against a
      mesh, whose contact is the mesh vertex the launch chose, read back from the contact it wrote), only for the
      pairs the model has; friction, ``solref``, ``solimp`` and the margin from ``geom_friction``, ``geom_solref``,
      ``geom_solimp``, ``geom_solmix`` and ``geom_margin`` as ``collision_core.contact_material_params`` mixes
      them (contact stiffness, damping, impedance and margins differentiate); the margin and the gap also decide
      which contacts are made (and which of two boxes' clipped corners), not differentiated. A contact the JAX
      computes otherwise than the launch wrote it (beyond ``CONTACT_AGREEMENT``: another branch taken at a tie) has
      a NaN derivative. Other primitive pairs, or explicit ``<pair>`` contacts, make the rule refuse, naming them.
    * ``constraint._efc_contact_jac_dense``: the contact rows of the dense constraint Jacobian (a tile kernel:
      ``wp.tile_reduce`` has no adjoint). Rule: each row from ``cdof``, ``subtree_com``, the contact's position,
      frame and friction (a pyramid's edges; an elliptic cone's rows along and about the frame's axes), and
      ``efc.Jqvel`` += ``J qvel``, as the kernel computes them.

    The broadphase writes integers only (pair lists): no cotangent reaches it.
    """
    import numpy as np
    from mujoco_warp._src import collision_convex, collision_primitive, constraint, types
    from mujoco_warp._src.math import upper_trid_index

    elliptic = m.opt.cone == types.ConeType.ELLIPTIC
    ruled = {(int(types.GeomType[a.upper()]), int(types.GeomType[b.upper()])): f"{a}-{b}"
             for a, b in (name.split("-") for name in _PAIR_CONTACTS)}
    geom_type = np.asarray(m.geom_type.numpy())
    geom_priority = np.asarray(m.geom_priority.numpy())
    geom_bodyid = np.asarray(m.geom_bodyid.numpy())
    body_rootid = np.asarray(m.body_rootid.numpy())
    roots = np.unique(body_rootid[geom_bodyid])  # the subtree roots contacts are offset from
    isdofancestor = np.asarray(m.body_isdofancestor.numpy())[:, : m.nv] != 0
    ntypes = len(types.GeomType)
    primitive = {(int(a), int(b)) for a, b in collision_primitive._PRIMITIVE_COLLISIONS}
    if not m.opt.disableflags & types.DisableBit.NATIVECCD:  # (box-box then goes to the convex narrowphase)
        primitive.discard((int(types.GeomType.BOX), int(types.GeomType.BOX)))
    present = [(t1, t2) for t1 in range(ntypes) for t2 in range(t1, ntypes)
               if (t1, t2) in primitive and m.geom_pair_type_count[upper_trid_index(ntypes, t1, t2)]]
    unruled = [f"{types.GeomType(t1).name.lower()}-{types.GeomType(t2).name.lower()}" for t1, t2 in present
               if (t1, t2) not in ruled]
    unsupported = (f"explicit contact pairs (<pair>: {m.npair})" if m.npair else
                   f"the primitive collisions {unruled}" if unruled else None)
    contact_floats = ("contact_dist_out", "contact_pos_out", "contact_frame_out", "contact_includemargin_out",
                      "contact_friction_out", "contact_solref_out", "contact_solreffriction_out",
                      "contact_solimp_out", "contact_adhesion_out")

    def narrowphase_rule(before, after):
        if unsupported is not None:
            raise NotImplementedError(f"collision narrowphase: the rule computes {sorted(ruled.values())} "
                                      f"contacts; this model has {unsupported}")
        slot = jnp.arange(after["contact_dist_out"].shape[0])
        written = (slot >= before["nacon_out"][0]) & (slot < after["nacon_out"][0])
        pairs = jnp.clip(after["contact_geom_out"], 0, geom_type.size - 1)
        nworld = before["geom_xpos_in"].shape[0]
        # (a slot nothing wrote reads some world's geoms and is masked out below: each its own world, so that the
        # zero cotangents of a mostly empty contact buffer do not all add into one world's geoms)
        world = jnp.where(written, jnp.clip(after["contact_worldid_out"], 0, nworld - 1), slot % nworld)
        g1, g2 = pairs[:, 0], pairs[:, 1]
        xpos, xmat = before["geom_xpos_in"], before["geom_xmat_in"]

        def geom(name, g):  # a geom parameter for each slot's world (one gather: no (slot, geom) table)
            return before[name][world % before[name].shape[0], g]

        geoms = [(xpos[world, g], xmat[world, g], geom("geom_size", g)) for g in (g1, g2)]
        cid = after["contact_geomcollisionid_out"]
        kind = jnp.asarray(geom_type)[g1] * ntypes + jnp.asarray(geom_type)[g2]
        # the pairs the model has, and only those (each pair's JAX runs on every slot), selected per slot by kind; a
        # written slot of any other kind (none, by mujoco_warp's pair counts) would be NaN, never another pair's
        nan = jnp.asarray(jnp.nan, xpos.dtype)
        computed = {name: jnp.full(after[name].shape, nan)
                    for name in ("contact_dist_out", "contact_pos_out", "contact_frame_out")}
        gap = after["geom_gap"]
        launch = {"band": (geom("geom_margin", g1) + geom("geom_margin", g2)  # (contact_margin_gap's margin + gap)
                           + gap[world % gap.shape[0], g1] + gap[world % gap.shape[0], g2]),
                  "dist": after["contact_dist_out"], "pos": after["contact_pos_out"]}
        for pair in present:
            dist, pos, frame = _PAIR_CONTACTS[ruled[pair]](*geoms[0], *geoms[1], cid, launch)
            case = kind == pair[0] * ntypes + pair[1]
            computed.update(contact_dist_out=jnp.where(case, dist, computed["contact_dist_out"]),
                            contact_pos_out=jnp.where(case[:, None], pos, computed["contact_pos_out"]),
                            contact_frame_out=jnp.where(case[:, None, None], frame, computed["contact_frame_out"]))
        # a written slot where the JAX took another branch than the launch did (a tie its rounding broke the other
        # way: which capsule end, which face of a box) would differentiate another contact than the one the step
        # made: its derivative is NaN (a factor of 1 elsewhere), never that other contact's
        # (each of the three must agree: parallel capsules' two contacts share their distance and frame)
        agree = jnp.ones(slot.size, bool)
        for name in ("contact_dist_out", "contact_pos_out", "contact_frame_out"):
            equal = computed[name] == after[name]  # (infinities included: a pair's unmade contact)
            difference = jnp.where(equal, 0.0, jnp.abs(computed[name] - after[name])).reshape(slot.size, -1)
            magnitude = jnp.where(jnp.isfinite(after[name]), jnp.abs(after[name]), 0.0).reshape(slot.size, -1)
            agree &= difference.max(-1) <= CONTACT_AGREEMENT * jnp.maximum(1.0, magnitude.max(-1))
        same = ~written | agree
        for name in ("contact_dist_out", "contact_pos_out", "contact_frame_out"):
            factor = jnp.where(same, 1.0, nan).reshape((-1,) + (1,) * (computed[name].ndim - 1))
            computed[name] = computed[name] * factor
        f1, f2 = geom("geom_friction", g1), geom("geom_friction", g2)
        q1, q2 = jnp.asarray(geom_priority)[g1][:, None], jnp.asarray(geom_priority)[g2][:, None]
        mixed = jnp.where(q1 > q2, f1, jnp.where(q2 > q1, f2, jnp.maximum(f1, f2)))
        friction = mixed[:, jnp.array([0, 0, 1, 2, 2])]
        # the pair's solver parameters, as collision_core.contact_material_params mixes them (solmix weights the
        # two geoms where neither has priority) and contact_margin_gap adds the margins
        w1, w2 = geom("geom_solmix", g1), geom("geom_solmix", g2)
        small1, small2 = w1 < types.MJ_MINVAL, w2 < types.MJ_MINVAL
        even = w1 / jnp.where(w1 + w2 != 0.0, w1 + w2, types.MJ_MINVAL)  # (math.safe_div)
        even = jnp.where(small1 & small2, 0.5, jnp.where(small1, 0.0, jnp.where(small2, 1.0, even)))
        mix = jnp.where(q1[:, 0] > q2[:, 0], 1.0, jnp.where(q2[:, 0] > q1[:, 0], 0.0, even))[:, None]
        s1, s2 = geom("geom_solref", g1), geom("geom_solref", g2)
        both_positive = ((s1[:, 0] > 0.0) & (s2[:, 0] > 0.0))[:, None]  # (else direct mode: the smaller)
        solref = jnp.where(both_positive, mix * s1 + (1.0 - mix) * s2, jnp.minimum(s1, s2))
        solimp = mix * geom("geom_solimp", g1) + (1.0 - mix) * geom("geom_solimp", g2)
        computed.update(contact_friction_out=friction, contact_solref_out=solref, contact_solimp_out=solimp,
                        contact_includemargin_out=geom("geom_margin", g1) + geom("geom_margin", g2))
        out = {}
        for name in contact_floats:  # (the rest: functions of model constants, as the launch wrote them)
            value = computed.get(name, after[name])
            mask = written.reshape(written.shape + (1,) * (value.ndim - 1))
            out[name] = jnp.where(mask, value, before[name])
        return out

    def jacobian_rule(before, after):
        nv = m.nv
        J, Jqvel = before["efc_J_out"], before["efc_Jqvel_out"]
        rows = jnp.arange(J.shape[1])[None, :]
        first = (after["ne_in"] + after["nf_in"] + after["nl_in"])[:, None]
        contact_row = (rows >= first) & (rows < jnp.minimum(after["nefc_in"], J.shape[1])[:, None])
        ncon = after["condim_in"].shape[0]
        world = jnp.arange(J.shape[0])[:, None]
        # The contact of each row: rows that are not a contact's read some contact and are masked out below, each a
        # different one, so that in reverse their zero cotangents do not all add into the same contact's pos and
        # frame (on a GPU, atomic adds into one element queue: 3 ms a step for the humanoid at 8,192 worlds).
        con = jnp.where(contact_row, jnp.clip(after["efc_id_in"], 0, ncon - 1), (world * J.shape[1] + rows) % ncon)
        geoms = after["geom_in"][con]

        # A contact row is d . Jp2 - d . Jp1 (+ w . Jr2 - w . Jr1 for a torsional or rolling row): the point Jacobians
        # of the two geoms' bodies, projected on the row's linear direction d (the normal, plus the signed friction
        # direction of a pyramid's edge) and angular direction w. With cdof = (angular, linear) per dof and the
        # contact point's offset r from the body's subtree root: Jp = cdof_lin + cdof_ang x r and Jr = cdof_ang, so
        # d . Jp + w . Jr = cdof . (r x d + w, d). Projecting first keeps every intermediate (world, row, dof)-sized.
        frame = before["frame_in"][con]  # (world, row, 3 axes, 3)
        condim = after["condim_in"][con]
        dimid = rows - after["contact_efc_address_in"][con, 0]

        def frame_axis(axis):  # (selects, not a gather: no scatter-add into the frames in reverse)
            return jnp.where(axis == 0, frame[:, :, 0], jnp.where(axis == 1, frame[:, :, 1], frame[:, :, 2]))

        if elliptic:  # rows 0-2: along the frame's axes; 3-5 (torsional, rolling): about them
            side = frame_axis(jnp.clip(jnp.where(dimid < 3, dimid, dimid - 3), 0, 2)[..., None])
            linear = jnp.where(dimid[..., None] < 3, side, 0.0)
            angular = jnp.where(dimid[..., None] >= 3, side, 0.0)
        else:  # a pyramid's edge: the normal plus or minus the friction-scaled tangent (or spin, rolling) direction
            which = jnp.clip(dimid // 2, 0, 4)  # tangent 1, 2, then spin, rolling 1, 2
            friction = jnp.sum(jnp.where(which[..., None] == jnp.arange(5), before["friction_in"][con], 0.0), -1)
            sign = jnp.where(condim > 1, friction * (1.0 - 2.0 * (dimid & 1)), 0.0)[..., None]
            side = frame_axis(jnp.where(which < 2, which + 1, which - 2)[..., None])  # the friction direction's
            linear = frame[:, :, 0] + jnp.where(which[..., None] < 2, sign * side, 0.0)
            angular = jnp.where(which[..., None] >= 2, sign * side, 0.0)
        pos = before["pos_in"][con]
        body = jnp.asarray(geom_bodyid)[geoms]  # (world, row, 2 geoms)
        root = jnp.asarray(body_rootid)[body]
        com = _root_centres_of_mass(before["subtree_com_in"], root, roots, contact_row)
        offset = pos[:, :, None] - com  # (world, row, 2, 3)
        direction = jnp.concatenate([jnp.cross(offset, linear[:, :, None]) + angular[:, :, None],
                                     jnp.broadcast_to(linear[:, :, None], offset.shape)], -1)
        # Both geoms' rows as one matrix product per world, (2 rows, 6) x (6, dof), whose transposes are matrix
        # products too (cuBLAS GEMMs, unlike the matrix-vector products _matvec keeps out of cuBLAS). As a sum of
        # products XLA's reverse transposed the (world, row, dof) cotangent: 9.6 against 9.0 ms per step of the
        # humanoid's forward and backward at 8,192 worlds (H100).
        projected = jnp.einsum("wrk,wvk->wrv", direction.reshape(J.shape[0], -1, 6), before["cdof_in"][:, :nv],
                               precision=jax.lax.Precision.HIGHEST).reshape(*body.shape, nv)
        projected = jnp.where(jnp.asarray(isdofancestor)[body], projected, 0.0)
        row = projected[:, :, 1] - projected[:, :, 0]
        jqvel = _matvec(row, before["qvel_in"][:, :nv])
        row = jnp.pad(row, ((0, 0), (0, 0), (0, J.shape[2] - nv)))
        return {"efc_J_out": jnp.where(contact_row[..., None], row, J),
                "efc_Jqvel_out": jnp.where(contact_row, Jqvel + jqvel, Jqvel)}

    narrowphase = warpnn.StageRule(
        collision_primitive, "_primitive_narrowphase", narrowphase_rule, per_launch=True,
        reads=lambda **a: {n: a[n] for n in ("geom_xpos_in", "geom_xmat_in", "geom_size", "geom_friction",
                                              "geom_solmix", "geom_solref", "geom_solimp", "geom_margin",
                                              "nacon_out", *contact_floats)},
        writes=lambda **a: {n: a[n] for n in contact_floats},
        # the gap decides only which contacts are made (and which of two boxes' clipped corners): context; no float
        # written depends on it
        context=lambda **a: {n: a[n] for n in ("contact_geom_out", "contact_worldid_out",
                                                "contact_geomcollisionid_out", "nacon_out", "geom_gap")},
    )
    jacobian = warpnn.StageRule(
        constraint, "_efc_contact_jac_dense", jacobian_rule, per_launch=True,
        reads=lambda **a: {n: a[n] for n in ("cdof_in", "subtree_com_in", "pos_in", "frame_in", "friction_in",
                                              "qvel_in", "efc_J_out", "efc_Jqvel_out")},
        writes=lambda **a: {n: a[n] for n in ("efc_J_out", "efc_Jqvel_out")},
        context=lambda **a: {n: a[n] for n in ("ne_in", "nf_in", "nl_in", "nefc_in", "efc_id_in", "condim_in",
                                                "geom_in", "contact_efc_address_in")},
    )
    boxes = (int(types.GeomType.BOX),) * 2
    box_hint = ("; for two boxes, turn the model's native convex collision off (<option><flag nativeccd=\"disable\"/>"
                "</option>): mujoco_warp, as MuJoCo, then collides them by MuJoCo's box-box collider, which "
                "differentiates"
                if boxes not in primitive and m.geom_pair_type_count[upper_trid_index(ntypes, *boxes)] else "")

    def convex_rule(before, after):
        raise NotImplementedError(f"collision narrowphase (convex, GJK/EPA): the contacts of meshes and of the pairs "
                                  f"mujoco_warp collides by GJK/EPA are not differentiated{box_hint}")

    convex = warpnn.StageRule(  # (a refusal that teaches; the kernel's own facts would list its loops and atomics)
        collision_convex, "ccd_kernel_builder", convex_rule, per_launch=True,
        reads=lambda **a: {n: a[n] for n in ("geom_xpos_in", "geom_xmat_in")},
        writes=lambda **a: {n: a[n] for n in contact_floats})
    return [narrowphase, jacobian, convex]


def _impedance(solref, solimp, distance, timestep, refsafe: bool):
    """mujoco_warp's ``constraint._contact_kbimp``: a constraint row's stiffness ``k``, damping ``b`` and
    impedance at ``distance`` from ``solref`` (time constant and damping ratio, or direct when not positive) and
    ``solimp`` (``dmin, dmax, width, mid, power``), the continuous integrators' way (MuJoCo's ``getsolparam`` and
    ``getimpedance``)."""
    from mujoco_warp._src import types

    low, high = types.MJ_MINIMP, types.MJ_MAXIMP
    timeconst, dampratio = solref[..., 0], solref[..., 1]
    if refsafe:
        timeconst = jnp.maximum(timeconst, 2.0 * timestep)
    dmin, dmax = jnp.clip(solimp[..., 0], low, high), jnp.clip(solimp[..., 1], low, high)
    width = jnp.maximum(types.MJ_MINVAL, solimp[..., 2])
    mid, power = jnp.clip(solimp[..., 3], low, high), jnp.maximum(1.0, solimp[..., 4])
    k = jnp.where(solref[..., 0] <= 0.0, -solref[..., 0] / jnp.maximum(types.MJ_MINVAL, dmax * dmax),
                  1.0 / jnp.maximum(types.MJ_MINVAL, dmax * dmax * timeconst * timeconst * dampratio * dampratio))
    b = jnp.where(solref[..., 1] <= 0.0, -solref[..., 1] / jnp.maximum(types.MJ_MINVAL, dmax),
                  2.0 / jnp.maximum(types.MJ_MINVAL, dmax * timeconst))
    x = jnp.abs(distance) / width
    inside = (x > 0.0) & (x < 1.0)
    y = jnp.where(inside, x, 0.5)  # (the power branches at a safe point where they are not taken)
    rising = jnp.power(y, power) / jnp.power(mid, power - 1.0)
    falling = 1.0 - jnp.power(1.0 - y, power) / jnp.power(1.0 - mid, power - 1.0)
    curve = jnp.clip(dmin + jnp.where(power == 1.0, y, jnp.where(y <= mid, rising, falling)) * (dmax - dmin),
                     dmin, dmax)
    imp = jnp.where((dmin == dmax) | (solimp[..., 2] <= types.MJ_MINVAL), 0.5 * (dmin + dmax),
                    jnp.where(x <= 0.0, dmin, jnp.where(x >= 1.0, dmax, curve)))
    return k, b, imp


def _elliptic_rows_rule(m):
    """``constraint._efc_contact_update`` for elliptic cones, by a rule (``warpnn.StageRule(per_launch=True)``).

    Each thread writes a contact row's ``efc.D`` (and ``aref``, ``pos``, ...) through ``_efc_row`` and then, on a
    friction row, divides it in place (``efc_D_out[w, r] /= scale``) and overwrites ``aref``: Warp's adjoint of a
    store followed by a read and a store of the same element is wrong, and warpnn refuses it. Rule: the rows as the
    kernel computes them, in JAX: ``pos = dist - margin`` (0 on friction rows), ``D = imp / ((1 - imp) invweight)``
    (divided on friction row ``j`` by ``fri_0^2 / fri_j^2 / impratio``), ``aref = -k imp pos - b J qvel`` (friction
    rows: the damping of ``solreffriction`` where it is set), with ``k, b, imp`` from the contact's ``solref`` and
    ``solimp`` at its distance (:func:`_impedance`). Refused: the discrete integrator, adhesion.
    """
    import numpy as np
    from mujoco_warp._src import constraint, types

    constraint_contact = int(types.ContactType.CONSTRAINT)
    refsafe = not (m.opt.disableflags & types.DisableBit.REFSAFE)
    discrete = m.opt.integrator == types.IntegratorType.DISCRETE
    geom_bodyid = np.asarray(m.geom_bodyid.numpy())
    floats = ("efc_pos_out", "efc_margin_out", "efc_D_out", "efc_vel_out", "efc_aref_out", "efc_frictionloss_out")

    def rule(before, after):
        if discrete or m.flg_adhesion:
            raise NotImplementedError("the elliptic contact rows' rule covers the continuous integrators without "
                                      "adhesion; this model has " + ("the discrete integrator" if discrete else
                                                                     "adhesion actuators"))
        contacts, slots = after["contact_efc_address_in"].shape
        slot = jnp.arange(slots)[None, :]
        count = after["nacon_in"][0]
        condim = after["condim_in"][:, None]
        row = after["contact_efc_address_in"]
        made = (jnp.arange(contacts) < count) & ((after["type_in"] & constraint_contact) != 0)
        valid = made[:, None] & (slot < condim) & (row >= 0)
        nworld = before["efc_D_out"].shape[0]
        world = jnp.clip(after["worldid_in"], 0, nworld - 1)
        timestep = before["opt_timestep"][world % before["opt_timestep"].shape[0]]
        ratio = before["opt_impratio_invsqrt"][world % before["opt_impratio_invsqrt"].shape[0]]
        bodies = jnp.asarray(geom_bodyid)[jnp.clip(after["geom_in"], 0, geom_bodyid.size - 1)]  # (contact, 2)
        weights = before["body_invweight0"][(world % before["body_invweight0"].shape[0])[:, None], bodies, 0]
        invweight = jnp.sum(weights, -1)
        margin = before["includemargin_in"]
        distance = before["dist_in"] - margin
        k, b, imp = _impedance(before["solref_in"], before["solimp_in"], distance, timestep, refsafe)
        D = 1.0 / jnp.maximum(invweight * (1.0 - imp) / imp, types.MJ_MINVAL)
        friction = before["friction_in"]
        own_friction = jnp.where(slot >= 2, friction[:, jnp.clip(slot[0] - 1, 0, 4)], 1.0)  # fri_j from row 2
        first = jnp.where(slot >= 2, friction[:, :1] ** 2 / own_friction ** 2, 1.0)  # fri_0^2 / fri_j^2
        scale = jnp.where(slot >= 1, (ratio * ratio)[:, None] * first, 1.0)
        solreffriction = before["solreffriction_in"]
        own = jnp.any(solreffriction != 0.0, -1, keepdims=True)  # (else the friction rows take solref's)
        _, b_friction, _ = _impedance(jnp.where(own, solreffriction, before["solref_in"]), before["solimp_in"],
                                      distance, timestep, refsafe)
        r = jnp.clip(row, 0, before["efc_D_out"].shape[1] - 1)
        jqvel = before["efc_Jqvel_in"][world[:, None], r]
        position = jnp.where(slot >= 1, 0.0, distance[:, None])
        values = {
            "efc_pos_out": position + margin[:, None],
            "efc_margin_out": jnp.broadcast_to(margin[:, None], row.shape),
            "efc_D_out": D[:, None] / scale,
            "efc_vel_out": jqvel,
            "efc_aref_out": jnp.where(slot >= 1, -b_friction[:, None] * jqvel,
                                      -(k * imp)[:, None] * position - b[:, None] * jqvel),
            "efc_frictionloss_out": jnp.zeros(row.shape, jqvel.dtype),
        }
        target_world = jnp.where(valid, world[:, None], nworld)  # (rows no thread writes: dropped)
        return {name: before[name].at[target_world, r].set(value, mode="drop") for name, value in values.items()}

    return warpnn.StageRule(
        constraint, "_efc_contact_update", rule, per_launch=True,
        reads=lambda **a: {n: a[n] for n in ("opt_timestep", "opt_impratio_invsqrt", "body_invweight0",
                                              "efc_Jqvel_in", "dist_in", "includemargin_in", "friction_in",
                                              "solref_in", "solreffriction_in", "solimp_in", *floats)},
        writes=lambda **a: {n: a[n] for n in floats},
        ignores=lambda adhesion_in, **_: {"adhesion_in": adhesion_in},  # (read only with adhesion: refused)
        context=lambda **a: {n: a[n] for n in ("contact_efc_address_in", "nacon_in", "condim_in", "worldid_in",
                                                "geom_in", "type_in")},
    )


def _warn_of_static_geoms(mjm, param_fields: Sequence[str]) -> None:
    """Warn where ``geom_pos`` / ``geom_quat`` parameters cover geoms the step never places.

    mujoco_warp places a geom attached to the world (not under a mocap body) once, in ``put_data``
    (``smooth._geom_local_to_global`` returns early for it), so its step reads neither array there: those entries
    change nothing and their gradient is 0, where ``mj_step`` would move the geom."""
    import mujoco
    import numpy as np

    fields = [f for f in ("geom_pos", "geom_quat") if f in param_fields]
    if not fields:
        return
    body = mjm.geom_bodyid
    static = np.nonzero((mjm.body_weldid[body] == 0) & (mjm.body_mocapid[mjm.body_rootid[body]] == -1))[0]
    if not static.size:
        return
    names = [mujoco.mj_id2name(mjm, mujoco.mjtObj.mjOBJ_GEOM, int(g)) or f"geom {g}" for g in static]
    warnings.warn(
        f"MujocoStep: param_fields {fields}: mujoco_warp places the geoms attached to the world ({names[:8]}"
        f"{' ...' if len(names) > 8 else ''}) once, in put_data, and its step never reads their entries of "
        f"{' and '.join(fields)}: changing them changes nothing and their gradient is 0 (mj_step would move them). "
        "The entries of geoms on moving bodies differentiate; to move a static geom, build the step from a changed "
        "MjModel.", stacklevel=3)


def _load(model):
    import mujoco

    if isinstance(model, mujoco.MjModel):
        return model
    if isinstance(model, (str, os.PathLike)) and not str(model).lstrip().startswith("<") and os.path.exists(model):
        return mujoco.MjModel.from_xml_path(os.fspath(model))
    if isinstance(model, str):
        return mujoco.MjModel.from_xml_string(model)
    raise TypeError(f"MujocoStep: model must be a mujoco.MjModel, an MJCF string or a path, got {type(model).__name__}.")


class MujocoStep:
    """One ``mujoco_warp.step`` as a pure JAX function ``step(state, params=None) -> state``.

    Args:
        model: a ``mujoco.MjModel``, an MJCF string, or the path of an MJCF file.
        data: a ``mujoco.MjData`` of ``model`` to start from (default: ``mujoco.MjData(model)`` after
            ``mj_forward``); its values are the initial state.
        state_fields: ``Data`` arrays in and out of the step (default: ``qpos``, ``qvel``, ``act``, ``ctrl``,
            ``time``, the applied forces ``qfrc_applied`` and ``xfrc_applied``, and every other array the step writes
            and reads back). Given explicitly, leaving out such an
            array is an error: every replayed step would restart it from its value when the step was traced.
        param_fields: ``Model`` arrays taken per call (``body_mass``, ``dof_damping``, ``actuator_gainprm``, ...).
        nworld: the number of worlds the step advances at once (``mujoco_warp.put_data``'s): each state array has
            mujoco_warp's leading world axis (``qpos``: ``(nworld, nq)``), each kernel is one launch over every
            world, and ``data``'s values start each one. The way to step many worlds: under ``jax.vmap`` of an
            ``nworld=1`` step, some of mujoco_warp's kernels launch once per batch element on a GPU (a warning
            names each and why).
        nconmax, njmax: contact and constraint capacity per world (``mujoco_warp.put_data``'s).
        sparse_jacobian: ``True``: trace with a sparse constraint Jacobian, ``False``: with a dense one (a copy of
            ``model`` with ``opt.jacobian`` set to ``mjJAC_SPARSE`` / ``mjJAC_DENSE``; same physics, float rounding
            aside). Default (``None``): the model's own, where MuJoCo's ``mjJAC_AUTO`` is sparse above 32 dofs in
            mujoco_warp. Reverse mode through the constraint solver needs a dense one: ``False`` differentiates
            such a model. (With
            a dense Jacobian and ``nv <= 50`` mujoco_warp's line search writes ``ctx.jv`` through one parameter and
            reads it back through another bound to the same array in the same launch; the tracer replays that
            kernel with the two parameters merged, as Warp runs it.)
        solver_loop: how the constraint solver's iterations replay. ``"while"``: as mujoco_warp's own graph runs
            them, a ``wp.capture_while`` replayed as a ``lax.while_loop`` (as many iterations as the step needs,
            one compiled). ``"fixed"``: ``m.opt.graph_conditional = False``, mujoco_warp's loop of
            ``opt.iterations`` iterations, each returning early once converged (every iteration launched and
            compiled). ``"auto"`` (default): ``"while"``, or ``"fixed"`` with a warning where the tracer refuses
            the loop (a body that launches other operations on a later iteration).

    Attributes:
        mjm: the ``mujoco.MjModel``. m, d: the ``mujoco_warp`` Model and Data the step was traced on.
        program: the :class:`warpnn.WarpProgram` (``program.describe()`` lists its launches).
    """

    def __init__(
        self,
        model,
        data=None,
        *,
        state_fields: Sequence[str] | None = None,
        param_fields: Sequence[str] = (),
        nworld: int = 1,
        nconmax: int | None = None,
        njmax: int | None = None,
        sparse_jacobian: bool | None = None,
        solver_loop: str = "auto",
    ):
        import mujoco
        import mujoco_warp as mjw

        try:
            worlds = operator.index(nworld)  # (an int or a NumPy integer; not a float, not a bool)
        except TypeError:
            worlds = 0
        if isinstance(nworld, bool) or worlds < 1:
            raise ValueError(f"MujocoStep: nworld must be a positive int (the number of worlds), got {nworld!r}.")
        nworld = worlds
        self.mjm = _load(model)
        if sparse_jacobian not in (None, True, False):
            raise ValueError(f"MujocoStep: sparse_jacobian must be True, False or None (the model's own), got "
                             f"{sparse_jacobian!r}.")
        layout = {True: mujoco.mjtJacobian.mjJAC_SPARSE, False: mujoco.mjtJacobian.mjJAC_DENSE}.get(sparse_jacobian)
        swapped = layout is not None and self.mjm.opt.jacobian != layout
        if swapped:
            self.mjm = copy.copy(self.mjm)
            self.mjm.opt.jacobian = layout
        if data is None or swapped:  # (the constraint arrays of a given MjData are laid out for its model's Jacobian)
            given, data = data, mujoco.MjData(self.mjm)
            if given is not None:
                mujoco.mj_copyData(data, self.mjm, given)
            mujoco.mj_forward(self.mjm, data)
        self.m = mjw.put_model(self.mjm)
        if solver_loop not in ("auto", "while", "fixed"):
            raise ValueError(f"MujocoStep: solver_loop must be 'auto', 'while' or 'fixed', got {solver_loop!r}.")
        self.solver_loop = solver_loop
        self.m.opt.graph_conditional = solver_loop != "fixed"
        self.d = mjw.put_data(self.mjm, data, nworld=nworld, nconmax=nconmax, njmax=njmax)
        self._rules = _stage_rules(self.m)
        self.nworld = nworld
        self.param_fields = tuple(param_fields)
        self._data = data_arrays(self.d)
        model_arrays = data_arrays(self.m)
        for name in self.param_fields:
            if name not in model_arrays:
                raise ValueError(
                    f"MujocoStep: param_fields names '{name}', which is not a non-empty array of this mujoco_warp "
                    f"Model (arrays: {sorted(model_arrays)[:12]}...)."
                )
        self._params = {name: model_arrays[name] for name in self.param_fields}
        _warn_of_static_geoms(self.mjm, self.param_fields)
        if state_fields is not None:
            unknown = [n for n in state_fields if n not in self._data]
            if unknown:
                raise ValueError(f"MujocoStep: state_fields {unknown} are not non-empty arrays of this model's Data.")

        def trace(fields):
            self.state_fields = fields
            self._trace()

        self.state_fields = trace_carrying("MujocoStep", "Data arrays", state_fields,
                                           [n for n in STATE_FIELDS if n in self._data], trace,
                                           lambda fields: self._frozen_fields())
        self._initial = {k: jnp.asarray(v) for k, v in self.program.initial_inputs().items()}

    def _frozen_fields(self) -> list[str]:
        return self.program.frozen_state({n: (a, a) for n, a in self._data.items() if n not in self.state_fields})

    def _trace(self) -> None:
        import mujoco_warp as mjw

        inputs = {f"state/{n}": self._data[n] for n in self.state_fields}
        inputs.update({f"params/{n}": a for n, a in self._params.items()})
        outputs = {n: self._data[n] for n in self.state_fields}
        def trace() -> warpnn.WarpProgram:
            return warpnn.trace(lambda: mjw.step(self.m, self.d), inputs, outputs, rules=self._rules)

        try:
            self.program = trace()
        except TypeError as refused:
            if self.solver_loop != "auto" or not self.m.opt.graph_conditional or "wp.capture_while" not in str(refused):
                raise
            warnings.warn(f"MujocoStep: the solver's loop replays with a fixed count of opt.iterations "
                          f"({self.mjm.opt.iterations}) instead of as a lax.while_loop: {refused}", stacklevel=4)
            self.m.opt.graph_conditional = False
            self.program = trace()

    def reverse_refusals(self) -> dict[str, str]:
        """The step's kernels that reverse mode refuses today, ``{kernel key: "<stage>: <reason>"}``.

        The same checks the bridge makes when a gradient reaches a kernel (``jax.grad`` raises a ``TypeError``
        naming the first such kernel it meets, backwards from the outputs): reads of values other threads of the
        same launch write, dynamic loops whose adjoint Warp gets wrong, calls Warp has no adjoint for, arrays
        warpnn cannot follow. A kernel mujoco_warp compiles without an adjoint (``enable_backward=False`` on 25 of
        its modules) is differentiated through its twin built with one (``warpnn._twins.with_adjoint``), the
        installed package untouched. The stage is the mujoco_warp module (``smooth``, ``forward``, ``passive``,
        ``constraint``, ``solver``, ``collision_*``, ...). The inertia solve and the constraint solver are
        differentiated by their rules (``warpnn.StageRule``); a refused rule is listed under its function
        (``mujoco_warp._src.solver.solve``) with the reason.
        """
        modules = {rule.key: rule.key.rsplit(".", 2)[-2] for rule in self._rules}
        for op in self.program.launches():  # (a twin's key starts with its kernel's, as the refusals name it)
            modules.setdefault(op.kernel.key, getattr(op.kernel.func, "__module__", "?").rsplit(".", 1)[-1])
        return {key: f"{next(m for k, m in modules.items() if k.startswith(key))}: {why}"
                for key, why in self.program.reverse_refusals().items()}

    def initial_state(self) -> dict[str, jax.Array]:
        """The ``data`` given (or the model's default state) as the ``state`` pytree."""
        return {n: self._initial[f"state/{n}"] for n in self.state_fields}

    def initial_params(self) -> dict[str, jax.Array]:
        """The model's values of ``param_fields``, as the ``params`` pytree."""
        return {n: self._initial[f"params/{n}"] for n in self.param_fields}

    def constants(self) -> dict[str, jax.Array]:
        """The Model and scratch arrays the step reads (``WarpProgram.constants``), to pass through ``jax.jit``."""
        return self.program.constants()

    def __call__(
        self,
        state: Mapping[str, jax.Array],
        params: Mapping[str, jax.Array] | None = None,
        constants: Mapping[str, jax.Array] | None = None,
    ) -> dict[str, jax.Array]:
        """Advance ``state`` by one step; omitted ``params`` take the model's values."""
        params = self.initial_params() if params is None else params
        for what, given, fields in (("state", state, self.state_fields), ("params", params, self.param_fields)):
            if set(given) != set(fields):
                raise TypeError(
                    f"MujocoStep: {what} must have exactly the fields {sorted(fields)}, got {sorted(given)} "
                    f"(start from step.initial_{what}())."
                )
        inputs = {f"state/{k}": v for k, v in state.items()}
        inputs.update({f"params/{k}": v for k, v in params.items()})
        return self.program(inputs, constants)


def rollout(
    step: Callable,
    state: Mapping[str, jax.Array],
    controls: Mapping[str, jax.Array] | None = None,
    params: Mapping[str, jax.Array] | None = None,
    *,
    num_steps: int | None = None,
    checkpoint: bool = False,
    constants: Mapping[str, jax.Array] | None = None,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """``lax.scan`` of ``step`` over the leading axis of ``controls`` (or ``num_steps`` steps without controls).

    ``controls``: state fields set before each step, stacked over steps (``{"ctrl": (T, 1, nu)}``). Returns the
    final state and the trajectory: each state field stacked over steps, *after* each step. ``checkpoint=True``
    recomputes each step in the backward pass instead of storing its intermediates.
    """

    def body(carry, control):
        carry = {**carry, **(control or {})}
        new = step(carry, params) if constants is None else step(carry, params, constants)
        return new, new

    if checkpoint:
        body = jax.checkpoint(body)
    return jax.lax.scan(body, dict(state), controls, length=num_steps)


def _module_params(step: MujocoStep, params: Mapping[str, Any] | None):
    return {k: jnp.asarray(v) for k, v in (step.initial_params() if params is None else params).items()}


def nnx_module(step: MujocoStep, params: Mapping[str, Any] | None = None):
    """A Flax NNX module holding ``step``'s params as ``nnx.Param``s: ``module(state) -> state``."""
    from flax import nnx

    class MujocoModule(nnx.Module):
        def __init__(self, step, params):
            self.step = nnx.static(step) if hasattr(nnx, "static") else step
            self.params = nnx.data({k: nnx.Param(v) for k, v in params.items()})

        def __call__(self, state):
            return self.step(state, {k: v[...] for k, v in self.params.items()})

    return MujocoModule(step, _module_params(step, params))


def equinox_module(step: MujocoStep, params: Mapping[str, Any] | None = None):
    """An Equinox module whose ``params`` field holds ``step``'s params: ``module(state) -> state``."""
    import equinox as eqx

    class MujocoModule(eqx.Module):
        params: dict
        step: MujocoStep = eqx.field(static=True)

        def __call__(self, state):
            return self.step(state, self.params)

    return MujocoModule(_module_params(step, params), step)
