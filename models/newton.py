"""Newton's solvers inside JAX: a Newton model + solver as a differentiable step ``step(state, control, params)``.

`Newton <https://github.com/newton-physics/newton>`_ (``pip install "warpnn[newton]"``) steps with Python
that launches Warp kernels (``solver.step(state_in, state_out, control, contacts, dt)``). :class:`NewtonStep`
records one such step with :func:`warpnn.trace` and replays it as JAX operations, so a rollout is a
``lax.scan`` that ``jax.grad`` differentiates through Newton's own kernels' Warp adjoints, ``jax.vmap``
batches, and XLA compiles (and captures into CUDA graphs on a GPU) with no Python per step. Newton's code
runs unmodified.

The three pytrees are dicts named after Newton's fields:

* ``state``: ``State`` fields the step advances, default ``particle_q`` / ``particle_qd`` (and ``body_q`` /
  ``body_qd`` when the model has bodies);
* ``control``: external forces ``particle_f`` / ``body_f`` (Newton adds forces a caller left in
  ``state_in.particle_f`` / ``body_f``; without them the step clears both) and any ``Control`` array field
  (``joint_f``, ``tri_activations``, ...);
* ``params``: ``Model`` array fields to train or vary: materials (``spring_stiffness``, ``spring_damping``,
  ``tri_materials``, ``edge_bending_properties``, ``particle_inv_mass``, ...) and contact properties
  (``shape_material_ke`` / ``kd`` / ``kf`` / ``mu``). Model *scalars* (``soft_contact_ke``, ...) are Warp
  kernel scalars, fixed when the step is traced.

Solvers and how each was checked (``tests/test_models_newton.py``):

* ``SolverSemiImplicit``: forward (a 100-step cloth rollout with ground contact and friction equals Newton's
  own loop to <= 1e-6 m) and reverse (gradients w.r.t. per-step forces, the initial state, spring and triangle
  materials and contact stiffness equal ``wp.Tape``'s over the same rollout and agree with central
  differences); ``vmap`` equals per-element runs. Particle self-contact rebuilds a ``HashGrid`` on the host
  every step, which the replay refuses: set ``model.particle_grid = None`` (Newton's advice for gradients)
  or pass ``frozen_host_ops=True``.
* ``SolverXPBD``: forward only (Newton rates it not differentiable), equal to Newton's own loop; set
  ``model.particle_max_radius = 0`` or build no particle grid (its particle-particle contact rebuilds one).
* ``SolverFeatherstone``: forward only, equal to Newton's own loop on a 3-link pendulum chain (pass
  ``state_fields=("joint_q", "joint_qd", "body_q", "body_qd")``). Reverse mode is refused by the bridge with
  the reason: its forward-kinematics kernels read elements that other threads of the same launch write, which
  Warp's adjoint cannot replay (one ``wp.Tape`` over many steps is several percent off finite differences).
* ``SolverMuJoCo`` (``use_mujoco_cpu=False``: mujoco_warp's step between Newton's coordinate conversions): forward
  only, equal to Newton's own loop on the same chain. Reverse mode is refused with the reasons (the constraint
  solver's ``wp.capture_while``, mujoco_warp's in-place Cholesky, Newton's forward kinematics). For gradients
  through mujoco_warp, step the MuJoCo model with :class:`warpnn_models.mujoco.MujocoStep`, whose stage rules
  differentiate the solver.

Example::

    model = builder.finalize()                     # any Newton model; requires_grad is not needed
    model.particle_grid = None
    step = NewtonStep(model, newton.solvers.SolverSemiImplicit(model, enable_tri_contact=False), dt=1e-3,
                      contacts=contacts, control_fields=("particle_f",), param_fields=("spring_stiffness",))
    final, trajectory = rollout(step, step.initial_state(), {"particle_f": forces}, step.initial_params())
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import warp as wp

import warpnn

from ._carry import trace_carrying

__all__ = ["NewtonStep", "rollout"]

EXTERNAL_FORCES = ("particle_f", "body_f")  # control fields that live on Newton's State


def _default_state_fields(model) -> tuple[str, ...]:
    fields = []
    if model.particle_count:
        fields += ["particle_q", "particle_qd"]
    if model.body_count:
        fields += ["body_q", "body_qd"]
    return tuple(fields)


class NewtonStep:
    """One Newton solver step as a pure JAX function ``step(state, control, params) -> state``.

    Args:
        model: a finalized ``newton.Model``.
        solver: a Newton solver built on ``model`` (the module's docstring says how each solver was checked and
            which differentiate).
        dt: the time step (static: a new ``dt`` needs a new ``NewtonStep``).
        contacts: the ``newton.Contacts`` the step uses, or ``None``. Contacts are captured as they are when the
            step is traced (as Newton's differentiable examples do for ground planes: collide once with a large
            ``soft_contact_gap``, and the contact kernels test penetration every step).
        state_fields: ``State`` fields in and out of the step (default: particle and body positions and
            velocities, as present, and every other field the step writes and reads back the next step, such as
            Featherstone's ``joint_q`` / ``joint_qd``). Given explicitly, leaving out such a field is an error.
        control_fields: external forces (``particle_f``, ``body_f``) and ``Control`` array fields taken per call.
        param_fields: ``Model`` array fields taken per call (trainable materials, contact properties, ...).
        frozen_host_ops: see :func:`warpnn.trace`.
    """

    def __init__(
        self,
        model,
        solver,
        dt: float,
        *,
        contacts=None,
        state_fields: Sequence[str] | None = None,
        control_fields: Sequence[str] = (),
        param_fields: Sequence[str] = (),
        frozen_host_ops: bool = False,
    ):
        self.model, self.solver, self.dt, self.contacts = model, solver, float(dt), contacts
        self.control_fields = tuple(control_fields)
        self.param_fields = tuple(param_fields)
        self._state_in, self._state_out = model.state(), model.state()
        self._control = model.control()
        # A solver's own Python state that its step changes, accepted where the launches provably do not depend on
        # it: Featherstone's step counters when it updates its mass matrix every step, and the revision of the Warp
        # module options every Newton solver re-applies at the start of a step once another solver has set its own
        # (a cache flag: the options are applied to the modules while tracing, and the recorded kernels are those
        # compiled with them). Any other Python state the step changes is refused by the trace.
        python_state = ("_applied_module_options_revision",)
        if getattr(solver, "update_mass_matrix_interval", 1) == 1:
            python_state += ("_step", "_mass_matrix_dirty")

        def trace(fields):
            self.state_fields = fields
            self._trace(frozen_host_ops, python_state)

        # Default: positions and velocities, plus every field the step writes and reads back (found by tracing)
        self.state_fields = trace_carrying("NewtonStep", "State fields", state_fields, _default_state_fields(model),
                                           trace, lambda fields: self._frozen_state_fields())
        self._initial = {k: jnp.asarray(v) for k, v in self.program.initial_inputs().items()}

    def _state_array_fields(self) -> list[str]:
        return [name for name, value in vars(self._state_in).items()
                if isinstance(value, wp.array) and value.size and name not in EXTERNAL_FORCES]

    def _frozen_state_fields(self) -> list[str]:
        pairs = {name: (getattr(self._state_in, name), getattr(self._state_out, name))
                 for name in self._state_array_fields() if name not in self.state_fields}
        return self.program.frozen_state(pairs)

    def _trace(self, frozen_host_ops: bool, python_state) -> None:
        inputs = {}
        for name in self.state_fields:
            inputs[f"state/{name}"] = _field(self._state_in, name, "State", "state_fields")
        for name in self.control_fields:
            owner = self._state_in if name in EXTERNAL_FORCES else self._control
            inputs[f"control/{name}"] = _field(owner, name, "Control", "control_fields")
        for name in self.param_fields:
            inputs[f"params/{name}"] = _field(self.model, name, "Model", "param_fields")
        outputs = {name: getattr(self._state_out, name) for name in self.state_fields}
        self.program = warpnn.trace(self._step_once, inputs, outputs, frozen_host_ops=frozen_host_ops,
                                    python_state=python_state)

    def _step_once(self) -> None:
        for name in EXTERNAL_FORCES:  # Newton's clear_forces, except for forces the caller passes in
            forces = getattr(self._state_in, name, None)
            if forces is not None and forces.size and name not in self.control_fields:
                forces.zero_()
        self.solver.step(self._state_in, self._state_out, self._control, self.contacts, self.dt)

    def _part(self, prefix: str, fields) -> dict[str, jax.Array]:
        return {name: self._initial[f"{prefix}/{name}"] for name in fields}

    def initial_state(self) -> dict[str, jax.Array]:
        """The model's initial state (``model.state()``) as the ``state`` pytree."""
        return self._part("state", self.state_fields)

    def initial_control(self) -> dict[str, jax.Array]:
        """Zero external forces and the model's default control, as the ``control`` pytree."""
        return self._part("control", self.control_fields)

    def initial_params(self) -> dict[str, jax.Array]:
        """The model's values of ``param_fields``, as the ``params`` pytree."""
        return self._part("params", self.param_fields)

    def constants(self) -> dict[str, jax.Array]:
        """The model's other arrays (connectivity, rest state, masses, contacts, ...): see ``WarpProgram.constants``.

        Pass them through ``jax.jit`` as an argument and on to each call (``rollout(..., constants=c)``) for large
        models: otherwise they are embedded in the compiled program.
        """
        return self.program.constants()

    def __call__(
        self,
        state: Mapping[str, jax.Array],
        control: Mapping[str, jax.Array] | None = None,
        params: Mapping[str, jax.Array] | None = None,
        constants: Mapping[str, jax.Array] | None = None,
    ) -> dict[str, jax.Array]:
        """Advance ``state`` by one step; omitted ``control`` / ``params`` take their initial values."""
        control = self.initial_control() if control is None else control
        params = self.initial_params() if params is None else params
        for what, given, fields in (("state", state, self.state_fields), ("control", control, self.control_fields),
                                    ("params", params, self.param_fields)):
            if set(given) != set(fields):
                raise TypeError(
                    f"NewtonStep: {what} must have exactly the fields {sorted(fields)} (set by {what}_fields / the "
                    f"constructor), got {sorted(given)}."
                )
        inputs = {f"state/{k}": v for k, v in state.items()}
        inputs.update({f"control/{k}": v for k, v in control.items()})
        inputs.update({f"params/{k}": v for k, v in params.items()})
        return self.program(inputs, constants)


def _field(owner, name: str, kind: str, argument: str) -> wp.array:
    value = getattr(owner, name, None)
    if isinstance(value, wp.array) and value.size:
        return value
    if value is None or isinstance(value, wp.array):
        raise ValueError(
            f"NewtonStep: {argument} names '{name}', but this model's {kind} has no such array"
            + (" (it is empty for this model)." if isinstance(value, wp.array) else ".")
        )
    raise TypeError(
        f"NewtonStep: {argument} names '{name}', but {kind}.{name} is a {type(value).__name__}, not a wp.array. "
        "Newton passes such values to kernels as static scalars, so they cannot vary per call or be trained; "
        "use a per-element array field instead (e.g. shape_material_ke rather than soft_contact_ke)."
    )


def rollout(
    step: Callable,
    state: Mapping[str, jax.Array],
    controls: Mapping[str, jax.Array] | None,
    params: Mapping[str, jax.Array] | None = None,
    *,
    num_steps: int | None = None,
    checkpoint: bool = False,
    constants: Mapping[str, jax.Array] | None = None,
    unroll: int = 1,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """``lax.scan`` of ``step`` over the leading axis of ``controls`` (or ``num_steps`` steps without controls).

    Returns the final state and the trajectory: each state field stacked over steps, *after* each step.
    ``checkpoint=True`` recomputes each step in the backward pass instead of storing its intermediates.
    ``constants``: ``step.constants()``, passed as an argument of the jitted function (large models).
    ``unroll``: steps per loop iteration (``lax.scan``'s): fewer, larger CUDA graphs on the GPU, which pays
    off for small models, where each iteration's fixed cost (graph launch, loop bookkeeping) dominates.
    For rollouts that continue each other (``state, _ = rollout(..., state, ...)`` in a Python loop), jit with
    the state donated (``donate_argnums``): XLA then need not copy it into the loop's buffers every call.
    """

    def body(carry, control):
        new = step(carry, control, params) if constants is None else step(carry, control, params, constants)
        return new, new

    if checkpoint:
        body = jax.checkpoint(body)
    return jax.lax.scan(body, dict(state), controls, length=num_steps, unroll=unroll)


def nnx_module(step: NewtonStep, params: Mapping[str, Any] | None = None):
    """A Flax NNX module holding ``step``'s params as ``nnx.Param``s: ``module(state, control) -> state``."""
    from flax import nnx

    class NewtonModule(nnx.Module):
        def __init__(self, step, params):
            self.step = nnx.static(step) if hasattr(nnx, "static") else step
            self.params = nnx.data({k: nnx.Param(jnp.asarray(v)) for k, v in params.items()})

        def __call__(self, state, control=None):
            return self.step(state, control, {k: v[...] for k, v in self.params.items()})

    return NewtonModule(step, step.initial_params() if params is None else params)


def equinox_module(step: NewtonStep, params: Mapping[str, Any] | None = None):
    """An Equinox module whose ``params`` field holds ``step``'s params: ``module(state, control) -> state``."""
    import equinox as eqx

    class NewtonModule(eqx.Module):
        params: dict
        step: NewtonStep = eqx.field(static=True)

        def __call__(self, state, control=None):
            return self.step(state, control, self.params)

    return NewtonModule({k: jnp.asarray(v) for k, v in (step.initial_params() if params is None else params).items()}, step)
