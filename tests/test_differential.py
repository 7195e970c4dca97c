"""The differential test over real Warp code: every launch of Newton's and MuJoCo Warp's steps and of warp.examples
programs, as warpnn replays it, against Warp running the same kernel on the same values.

A program is traced (warpnn.trace), then replayed once outside jit with each launch's arguments captured
(``WarpProgram._replay(on_launch=...)``): real kernels with real inputs. For each launch:

* forward: ``warpnn.jax_kernel`` against ``wp.launch`` (equal to 1e-5);
* reverse: ``jax.vjp`` against ``wp.Tape`` with the same random cotangents (1e-4 relative), and the directional
  derivative along a random direction against central differences (2e-2), wherever warpnn differentiates the
  kernel; where it refuses, the refusal must be a TypeError naming the kernel (never zeros);
* vmap: two perturbed copies batched against two calls;
* CPU threads (Newton's XPBD and SPH, whose kernels scatter with atomics): the forward and the gradient with every
  launch split over 3 threads, against one (on the CPU).

A struct argument is built as the Warp struct for wp.launch and held fixed (compared forward and in vmap; the
gradient is taken w.r.t. the kernel's other float arrays). Where the central differences at three step sizes disagree
with each other (the direction crosses a discontinuity) and wp.Tape agrees with warpnn, the count says so.

Each kernel is checked at its first launch. A mismatch is a failure: a silently wrong result. A kernel compiled
without an adjoint (mujoco_warp builds most so) is differentiated by warpnn through its twin built with one, and
wp.Tape runs that same twin. Measured 2026-12-04 and 05 on the CPU (kernels; vmap compared; reverse compared against
wp.Tape and central differences; reverse refused with the kernel named): Newton SemiImplicit cloth 6; 6; 6; 0.
Newton XPBD cloth 5; 5; 3; 2 and VBD cloth 4; 4; 1; 3 (checked in test_models_newton.py, on the steps its
forward tests trace). Newton Featherstone chain 14; 14; 7; 7. MuJoCo Warp
box on a plane 57; 54; 25; 28 (the arm: 58; 55; 29; 25). warp.examples: particle repulsion, wave, SPH, FDTD 3-D,
NanoVDB sampling, mesh sampling, the checkpointed fluid, tile n-body (below); the Navier-Stokes optimal
perturbation's whole forward (tile FFTs), its gradient against the wp.Tape the example trains with. 0 mismatches.
This test found the `wp.grad` call Warp does not differentiate (particle repulsion), the row-loop twin's lost
adjoints (mujoco_warp's `_cfrc`: a store before a `return`) and, through central differences, builtins Warp has no
adjoint for (`tile_cholesky_solve`). The whole programs (rollouts against the libraries' own loops) are in
test_models_newton.py and test_models_mujoco.py.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp

import warpnn
from warpnn import _unrolled
from warpnn._signature import signature_of
from warpnn._twins import with_adjoint

from .helpers import on_cpu_threads, on_one_device, warp_config_kept

newton = pytest.importorskip("newton")


@pytest.fixture(autouse=True)
def on_cpu():
    """Newton's scenes are built on Warp's CPU device (tests/test_models_newton.py): replay there too."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _warp_value(value, ndim_of, requires_grad):
    return wp.array(np.asarray(value), dtype=ndim_of, requires_grad=requires_grad)


def _warp_struct(struct_type, fields: dict):
    """A Warp struct instance of ``struct_type`` holding ``fields`` (the dict of JAX values warpnn takes for it)."""
    value = struct_type()
    for name, var in struct_type.vars.items():
        field = fields[name]
        if isinstance(field, dict):
            field = _warp_struct(var.type, field)
        elif wp.types.is_array(var.type):
            field = None if field is None else wp.array(np.asarray(field), dtype=var.type.dtype)
        setattr(value, name, field)
    return value


def _adjoint_kernel(record, args, results):
    """The kernel whose adjoint warpnn launches for this launch: its twin with the launch's loops unrolled
    (``_unrolled``) where that is what differentiates it, else the kernel (or its twin rebuilt with an adjoint)."""
    sig = signature_of(record.kernel, record.num_outputs, list(record.in_out_names), record.block_dim)
    params = record.kernel.adj.args
    scalars = {p.label: a for p, a in zip(params, args) if not wp.types.is_array(p.type) and not isinstance(a, dict)}
    shapes = {p.label: np.shape(a) for p, a in zip(params, args) if wp.types.is_array(p.type) and a is not None}
    shapes.update({name: np.shape(r) for name, r in zip(
        [*record.in_out_names, *(p.label for p in params[len(args):])], results)})
    adjoint_sig, _ = _unrolled.adjoint_signature(sig, scalars, shapes)
    return adjoint_sig.kernel if _unrolled.is_unrolled(adjoint_sig.kernel) else with_adjoint(record.kernel)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(1.0, np.abs(b).max())) if a.size else 0.0


# Inputs at a point where the kernel branches on their value, left out of the finite-difference direction: at
# gravcomp = 0 mujoco_warp's `if gravcomp:` skips a force linear in gravcomp, so the difference quotient sees
# the slope of the other branch; Warp's adjoint, like jax.grad of jnp.where, takes the branch taken. Likewise its
# passive springs at stiffness 0 (`has_stiffness = stiffness != 0.0 or ...`). Keys without a twin's suffix.
AT_A_BRANCH_POINT = {("_gravity_force__locals__kernel", "body_gravcomp"),
                     ("_spring_damper_dof_passive", "jnt_stiffness"),
                     ("_spring_damper_dof_passive", "jnt_stiffnesspoly")}


def check_launch(record, args, rng, counts: collections.Counter, failures: list, threaded_checks: list) -> None:
    """Compare one recorded launch, replayed by warpnn, with Warp running it (forward, wp.Tape, vmap); append to
    ``threaded_checks`` its forward and gradient to compute again with CPU threads on."""
    kernel = record.kernel
    params = kernel.adj.args
    if any(isinstance(a, dict) for a in args):  # (a struct's fields are held fixed: compared forward and in vmap)
        counts["struct arguments"] += 1
    call = warpnn.jax_kernel(kernel, num_outputs=record.num_outputs, in_out_argnames=list(record.in_out_names),
                             block_dim=record.block_dim)
    outputs = params[len(args):]
    output_dims = dict(record.output_dims) or None
    result_names = [*record.in_out_names, *(p.label for p in outputs)]

    def run(arguments):
        return call(*arguments, launch_dims=record.dims, output_dims=output_dims)

    results = run(args)
    counts["launches"] += 1
    # Warp, on the same values: in-out arrays updated in place, outputs zeroed first (as warpnn zeroes them)
    warp_args = []
    for p, a in zip(params, [*args, *results[len(record.in_out_names):]]):
        if isinstance(a, dict):
            warp_args.append(_warp_struct(p.type, a))
        elif not wp.types.is_array(p.type):
            warp_args.append(a)
        elif a is None:
            warp_args.append(None)
        else:
            a = np.asarray(a)
            float_array = bool(np.issubdtype(a.dtype, np.floating))
            if p.label in [q.label for q in outputs]:
                a = np.zeros_like(a)
            warp_args.append(wp.array(a, dtype=p.type.dtype, requires_grad=float_array))
    by_name = {p.label: w for p, w in zip(params, warp_args)}
    tape = wp.Tape()
    with tape:  # (Warp runs the kernel whose adjoint warpnn launches: the twin rebuilt with an adjoint, same source,
        # or the one with this launch's loops unrolled)
        wp.launch(_adjoint_kernel(record, args, results), record.dims, inputs=warp_args[: len(args)],
                  outputs=warp_args[len(args):], block_dim=record.block_dim or 256)
    for name, r in zip(result_names, results):
        if by_name[name] is not None:
            err = _rel(r, by_name[name].numpy().reshape(np.shape(r)))
            if err > 1e-5:
                failures.append((kernel.key, f"forward '{name}'", err))
    # vmap: two perturbed copies of the float inputs against two calls
    floats = [k for k, (p, a) in enumerate(zip(params, args)) if wp.types.is_array(p.type) and a is not None
              and np.issubdtype(np.asarray(a).dtype, np.floating)]
    if floats:
        scaled = [[a if k not in floats else a * s for k, a in enumerate(args)] for s in (1.0, 0.5)]

        def one(*vs):
            full = list(args)
            for k, v in zip(floats, vs):
                full[k] = v
            return run(full)

        batched = jax.vmap(one)(*[jnp.stack([s[k] for s in scaled]) for k in floats])
        for b, arguments in enumerate(scaled):
            for name, got, want in zip(result_names, batched, run(arguments)):
                err = _rel(got[b], want)
                if err > 1e-5:
                    failures.append((kernel.key, f"vmap '{name}'", err))
        counts["vmap compared"] += 1
    # reverse: jax.grad against wp.Tape with the same cotangents
    float_results = [(n, r) for n, r in zip(result_names, results)
                     if by_name[n] is not None and np.issubdtype(np.asarray(r).dtype, np.floating)]
    if not float_results or not floats:
        return
    cts = {n: np.asarray(rng.normal(size=np.shape(r)), np.asarray(r).dtype) for n, r in float_results}

    def loss(*vs):
        full = list(args)
        for k, v in zip(floats, vs):
            full[k] = v
        return sum((o * cts[n]).sum() for n, o in zip(result_names, run(full)) if n in cts)

    try:
        grads = jax.grad(loss, argnums=tuple(range(len(floats))))(*[args[k] for k in floats])
    except TypeError as error:
        if kernel.key not in str(error):
            failures.append((kernel.key, "refusal does not name the kernel", str(error)[:200]))
        counts["reverse refused (named)"] += 1
        return
    tape.backward(grads={by_name[n]: wp.array(cts[n], dtype=by_name[n].dtype) for n, _ in float_results})
    counts["reverse compared"] += 1
    # CPU threads on: the forward and the gradient with each launch split over several threads, against one
    # (run for all the program's launches at once, after its replay: see run_program)
    threaded_checks.append((kernel.key, lambda: (run(args), jax.grad(loss, argnums=tuple(range(len(floats))))(
        *[args[k] for k in floats])), (results, grads)))
    tape_mismatches = []
    for k, g in zip(floats, grads):
        name = params[k].label
        err = _rel(g, by_name[name].grad.numpy().reshape(np.shape(g)))
        if err > 1e-4:
            tape_mismatches.append((kernel.key, f"d/d'{name}' vs wp.Tape", err))
    # wp.Tape replays a kernel that updates an array in place on the values it wrote (warp.examples' SPH
    # `apply_bounds` clamps x in place and branches on x): there a mismatch is Warp's, if central differences
    # side with warpnn; anywhere else it is a failure.
    in_place = all(name.split("'")[1] in record.in_out_names for _, name, _ in tape_mismatches)
    if not in_place:
        failures += tape_mismatches
        tape_mismatches = []
    # ... and against central differences along a random direction: wp.Tape runs Warp's same adjoint, so only this
    # sees where that adjoint itself is wrong (a builtin without one, a loop it replays wrongly).
    x = [jnp.asarray(args[k]) for k in floats]
    v = [jnp.asarray(rng.normal(size=xi.shape), xi.dtype) * (jnp.abs(xi) + 1e-2)
         * (0.0 if (kernel.key.split("__wn")[0], params[k].label) in AT_A_BRANCH_POINT else 1.0)
         for xi, k in zip(x, floats)]
    slope = float(sum((gi * vi).sum() for gi, vi in zip(grads, v)))
    quotients = [float((loss(*[xi + eps * vi for xi, vi in zip(x, v)]) - loss(*[xi - eps * vi for xi, vi in zip(x, v)]))
                       / (2 * eps)) for eps in (1e-2, 3e-3, 1e-3)]
    err = min(abs(q - slope) / max(abs(q), abs(slope), 1e-3) for q in quotients)
    spread = (max(quotients) - min(quotients)) / max(max(abs(q) for q in quotients), 1e-3)
    if err > 2e-2 and spread > 0.5 and not tape_mismatches:
        # The quotients disagree with each other: the direction crosses a discontinuity (warp.examples' mesh sampler
        # picks a triangle by `wp.lower_bound` of a CDF, piecewise constant in it). No slope to compare with; the
        # gradient was compared with wp.Tape's, which agreed.
        counts["finite differences do not converge (wp.Tape agrees)"] += 1
        return
    counts["reverse compared with finite differences"] += 1
    if err > 2e-2:
        failures.append((kernel.key, "directional derivative vs central differences", slope, quotients))
        failures += tape_mismatches
    elif tape_mismatches:
        counts["wp.Tape wrong in place (central differences side with warpnn)"] += 1


def run_program(program, inputs, limit=None, part=(0, 1), cpu_threads=False):
    """Replay ``program`` once on ``inputs``, checking each launch (the first ``limit``); ``part=(k, n)`` checks
    the k-th of n interleaved shares of the kernels (so that pytest-xdist can check one program on several workers).
    ``cpu_threads``: also compare each launch's forward and gradient with CPU threads on (it recompiles every
    kernel's calls: on for programs whose kernels scatter with atomics, Newton's XPBD and SPH)."""
    rng = np.random.default_rng(0)
    counts: collections.Counter = collections.Counter()
    failures: list = []

    seen = set()

    def on_launch(record, args):
        # each kernel once, at its first launch (a step launches some kernels many times with the same shapes)
        if record.kernel in seen or (limit is not None and counts["launches"] >= limit):
            return
        seen.add(record.kernel)
        if len(seen) % part[1] != part[0]:
            return
        check_launch(record, args, rng, counts, failures, threaded_checks)

    threaded_checks: list = []
    program._replay(inputs, on_launch=on_launch)
    # (JAX's caches keep each lowering's thread decision: one switch for the whole program, not one per launch)
    threaded = on_cpu_threads(lambda: [compute() for _, compute, _ in threaded_checks]) if cpu_threads else None
    for (key, _, expected), got in zip(threaded_checks, threaded or ()):
        for what, values, wants in zip(("forward", "gradient"), got, expected):
            for value, want in zip(values, wants):
                if value is not None and _rel(value, want) > 1e-5:
                    failures.append((key, f"{what} with CPU threads on", _rel(value, want)))
        counts["CPU threads compared"] += 1
    return counts, failures


@pytest.mark.quick_compile
def test_newton_semi_implicit_cloth_launches():
    from warpnn_models.newton import NewtonStep

    from .test_models_newton import DT, PARAMS, cloth_scene

    model, solver, contacts = cloth_scene()
    step = NewtonStep(model, solver, DT, contacts=contacts, control_fields=("particle_f",), param_fields=PARAMS)
    counts, failures = run_program(step.program, step.program.initial_inputs())
    assert failures == [], failures
    assert counts["launches"] >= 6 and counts["reverse compared"] >= 6 and counts["vmap compared"] >= 6, counts


@pytest.mark.quick_compile
@pytest.mark.slow  # (23 s of a 2-core CPU with Warp's kernel cache empty; Featherstone's forward against Newton and
# its refusals run in CI: tests/test_models_newton.py)
def test_newton_featherstone_launches():
    from warpnn_models.newton import NewtonStep

    from .test_models_newton import DT, pendulum_chain

    model, solver, _ = pendulum_chain()
    step = NewtonStep(model, solver, DT)
    counts, failures = run_program(step.program, step.program.initial_inputs())
    assert failures == [], failures
    # (2 of the 8 refused since 2026-12-04, where wp.Tape agreed with warpnn and both were wrong: Warp's adjoint
    # never runs eval_rigid_jacobian's while loop backwards, and eval_rigid_id's loop over joint_qdd, when it runs,
    # leaves the adjoint a stale acceleration; tests/test_access.py shows both kinds of loop)
    assert counts["launches"] >= 14 and counts["reverse compared"] >= 6, counts


@pytest.mark.quick_compile
@pytest.mark.slow  # (110 s of CI's CPU; the box's step end to end: tests/test_models_mujoco.py)
@pytest.mark.parametrize("half", [0, 1])
def test_mujoco_warp_step_launches(half):
    """The box's kernels in two interleaved halves (each compiles its kernels' twins: on a cold Warp cache the
    whole set takes over a minute, which two workers then share)."""
    pytest.importorskip("mujoco_warp")
    from warpnn_models.mujoco import MujocoStep

    from .test_models_mujoco import BOX, start

    mjm, mjd = start(BOX)
    with on_one_device():  # (on a GPU host: both on the GPU, where mujoco_warp's tile Cholesky compiles)
        step = MujocoStep(mjm, mjd)
        counts, failures = run_program(step.program, step.program.initial_inputs(), part=(half, 2))
    assert failures == [], failures
    # (27 of the box's launches differentiate, 2026-12-05; the halves' bounds are from when 25 did: 15 and 10)
    assert counts["launches"] >= 25 and counts["vmap compared"] >= 25, counts
    assert counts["reverse compared"] >= (15, 10)[half], counts


def test_warp_example_particle_repulsion_launches():
    """warp.examples' particle repulsion (a hash-grid neighbour query, forces from ``wp.grad`` of a potential), two
    substeps traced. Its force kernel is refused in reverse mode: Warp's ``wp.grad(f)`` call is forward-only, so
    wp.Tape's gradient through the forces is zero where central differences are not (this test found that)."""
    example = pytest.importorskip("warp.examples.optim.example_particle_repulsion")
    with wp.ScopedDevice("cpu"):
        sim = example.Example()
        sim.sim_substeps = 2
        sim.grid.build(sim.positions, sim.grid_cell_size)  # (a host-side build: traced steps refuse it)
        sim.velocities.assign(np.random.default_rng(1).normal(size=(len(sim.velocities), 3)).astype(np.float32) * 0.1)
        state = {"x": sim.positions, "v": sim.velocities}
        program = warpnn.trace(sim.simulate, state, state)
        counts, failures = run_program(program, program.initial_inputs())
    assert failures == [], failures
    assert counts["launches"] == 2 and counts["vmap compared"] == 2, counts
    assert counts["reverse refused (named)"] == 1 and counts["reverse compared with finite differences"] == 1, counts


def test_warp_example_navier_stokes_perturbation_gradient_equals_wp_tape():
    """warp.examples' optimal perturbation of 2-D turbulence differentiates its forward (RK3 stages, a spectral
    Poisson solve by ``wp.tile_fft`` on a 512 x 512 grid, a loss by ``atomic_add``) with wp.Tape. The same forward,
    traced: the vorticity at lead time equals Warp's (1e-5; the loss's sum runs in another order: 1e-4), and
    ``jax.grad`` of the loss w.r.t. the perturbation equals the tape's gradient (measured 4e-7 relative, CPU)."""
    example = pytest.importorskip("warp.examples.optim.example_navier_stokes_perturbation")
    with on_one_device():
        sim = example.Example(spin_up_steps=0, lead_steps=2)
        sim.use_cuda_graph = False
        sim.delta_omega.assign(np.random.default_rng(0).normal(size=sim.delta_omega.shape).astype(np.float32) * 0.1)
        final = sim.omega_timesteps[sim.lead_steps]
        tape = wp.Tape()
        with tape:
            sim.forward()
        tape.backward(sim.loss)
        loss, omega, gradient = sim.loss.numpy().copy(), final.numpy().copy(), sim.delta_omega.grad.numpy().copy()
        tape.zero()
        program = warpnn.trace(sim.forward, {"delta": sim.delta_omega}, {"loss": sim.loss, "omega": final})
        assert program.reverse_refusals() == {}
        delta = jnp.asarray(sim.delta_omega.numpy())
        replayed = jax.jit(program)({"delta": delta})
        grad = jax.jit(jax.grad(lambda d: program({"delta": d})["loss"].sum()))(delta)
    np.testing.assert_allclose(replayed["omega"], omega, rtol=1e-5, atol=1e-5 * np.abs(omega).max())
    np.testing.assert_allclose(replayed["loss"], loss, rtol=1e-4)
    assert np.abs(gradient).max() > 0
    np.testing.assert_allclose(grad, gradient, rtol=0, atol=1e-4 * np.abs(gradient).max())


# warp.examples programs whose Example().step() (or render()) traces as it is (state: every float array the Example
# holds; host-side structures such as SPH's hash grid or the mesh sampler's wp.Mesh kept as built), with the
# Example's arguments, the method and its arguments: kernels checked; reverse compared with wp.Tape; of those, where central differences do
# not converge (a discontinuity, wp.Tape agreeing); reverse refused with the kernel named; and the Python state the
# step changes, accepted here (each launch is compared on its own; a replayed step would keep the traced values,
# warpnn.trace refuses without the acceptance: test_warp_examples_refused_with_the_reason). Measured 2026-12-05
# (CPU). (The particle repulsion example, above, runs two substeps from its own start: traced over a whole step,
# central differences of its `integrate` do not converge (-61k, -19k, -77k for the three steps), as at its periodic
# wrap.) Not here: the programs below that list, refused; mesh, raycast, marching cubes, swept volume and diffray
# need pxr (USD); the other tile examples have no Example class.
WARP_EXAMPLES = {
    # (the source moves each step: cx, cy are launch scalars)
    "core.example_wave": ({}, "step", (), (3, 3, 0, 0), ("sim_time", "cx", "cy")),
    # its in-place `apply_bounds`: wp.Tape's gradient is wrong there, central differences side with warpnn
    "core.example_sph": ({}, "step", (), (5, 3, 0, 2), ("sim_time",)),
    "core.example_fdtd_3d": ({}, "step", (), (3, 2, 0, 0), ()),  # (one launch has no float input)
    "core.example_nvdb": ({}, "step", (), (1, 1, 0, 0), ("sim_time",)),  # (a wp.Volume read by its uint64 id)
    "core.example_sample_mesh": ({}, "step", (), (1, 1, 1, 0), ("frame",)),  # (a CDF searched by wp.lower_bound)
    # (camera position and rotation passed by value: wp.vec3, wp.quat; no float array in)
    "core.example_raymarch": ({"height": 12, "width": 16}, "render", (), (1, 0, 0, 0), ()),
    "optim.example_fluid_checkpoint": ({"sim_steps": 4, "pressure_iterations": 4}, "step", (1,), (4, 4, 0, 0), ()),
    # (a tile kernel; the step swaps its two position buffers. 1024 bodies, 16 tiles of 64, not the default 16384:
    # the all-pairs kernel is quadratic, and one launch at its first call is what is checked)
    "tile.example_tile_nbody": ({"num_bodies": 1024}, "step", (), (1, 0, 0, 1), ("pos_array_0", "pos_array_1")),
}
# Attributes set on an Example after it is built. SPH's step runs 40 substeps of the same 5 kernels; each kernel is
# checked at its first launch, in the first substep, on the same values whatever the count: 2 substeps still
# replay a substep after the first (its grid rebuilt), without 38 more over 62,500 particles.
WARP_EXAMPLE_ATTRIBUTES = {"core.example_sph": {"sim_step_to_frame_ratio": 2}}


def _example(name: str, arguments: dict):
    import importlib
    import inspect

    pytest.importorskip("warp.examples")
    with warp_config_kept():  # (the FDTD example turns Warp's enable_backward off for the process when imported)
        module = importlib.import_module(f"warp.examples.{name}")
    parameters = inspect.signature(module.Example.__init__).parameters
    return module.Example(**arguments, **({"stage_path": None} if "stage_path" in parameters else {}))


def _float_arrays(sim) -> dict:
    return {k: v for k, v in vars(sim).items() if isinstance(v, wp.array) and v.size and v.numpy().dtype.kind == "f"}


@pytest.mark.parametrize("name", list(WARP_EXAMPLES))
def test_warp_example_launches(name):
    arguments, method, step_arguments, expected, python_state = WARP_EXAMPLES[name]
    with on_one_device():  # (the GPU on a GPU host: the Examples' own device)
        sim = _example(name, arguments)
        sim.use_cuda_graph = False  # (a captured graph is refused inside a traced step)
        for attribute, value in WARP_EXAMPLE_ATTRIBUTES.get(name, {}).items():
            assert hasattr(sim, attribute), (name, attribute)
            setattr(sim, attribute, value)
        state = _float_arrays(sim)
        program = warpnn.trace(lambda: getattr(sim, method)(*step_arguments), state, state, frozen_host_ops=True,
                               python_state=python_state)
        counts, failures = run_program(program, program.initial_inputs(), cpu_threads=name == "core.example_sph")
    launches, compared, not_converging, refused = expected
    assert failures == [], failures
    assert counts["launches"] == launches and counts["vmap compared"] >= min(1, compared + refused), counts
    assert counts["reverse compared"] == compared, counts
    assert counts["finite differences do not converge (wp.Tape agrees)"] == not_converging, counts
    assert counts["reverse compared with finite differences"] == compared - not_converging, counts
    assert counts["reverse refused (named)"] == refused, counts


# warp.examples whose step warpnn.trace refuses, and the reason it gives (each a step as the Example runs it).
REFUSED_WARP_EXAMPLES = {
    # (the graph is captured when the Example is built; its step replays it)
    "core.example_dem": ({}, r"called wp\.capture_launch"),
    "core.example_fluid": ({}, r"called wp\.capture_launch"),
    "core.example_graph_capture": ({}, r"called wp\.capture_launch"),
    # (three Runge-Kutta stages, each swapping two vorticity buffers: an odd number of swaps)
    "core.example_fft_poisson_navier_stokes_2d": ({}, r"changed Python state.*self\.omega_curr <array"),
}


@pytest.mark.parametrize("name", list(REFUSED_WARP_EXAMPLES))
def test_warp_examples_refused_with_the_reason(name):
    arguments, reason = REFUSED_WARP_EXAMPLES[name]
    with on_one_device():
        sim = _example(name, arguments)
        state = _float_arrays(sim)
        before = {k: v.numpy().copy() for k, v in state.items()}
        with pytest.raises(RuntimeError, match=reason):
            warpnn.trace(sim.step, state, state, frozen_host_ops=True)  # (DEM rebuilds its hash grid first)
        for k, v in state.items():  # the refused trace left the Example's arrays as they were
            np.testing.assert_array_equal(v.numpy(), before[k], err_msg=k)
