"""warpnn_models.newton: Newton's unmodified solvers replayed in JAX, against Newton's own loop and wp.Tape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp

newton = pytest.importorskip("newton")
pytestmark = pytest.mark.quick_compile  # (tests/conftest.py)

from warpnn import _batched  # noqa: E402
from warpnn_models.newton import NewtonStep, equinox_module, nnx_module, rollout  # noqa: E402

from .test_differential import run_program  # noqa: E402

T, DT = 100, 1e-3


@pytest.fixture(autouse=True)
def on_cpu(request):
    """Replay on the CPU, where Newton's reference loops run, so atomics add in one order (also on a GPU host).

    The CUDA test below opts out and runs both on the GPU."""
    if "gpu" in request.keywords:
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield
PARAMS = ("spring_stiffness", "tri_materials", "shape_material_ke")


def cloth_scene(requires_grad=False, solver="semi_implicit", device="cpu"):
    """A 5x5 cloth with springs thrown onto a ground plane (contact with friction)."""
    builder = newton.ModelBuilder()
    builder.add_cloth_grid(
        pos=wp.vec3(0.0, 0.0, 0.12), rot=wp.quat_identity(), vel=wp.vec3(0.3, 0.0, -0.5), dim_x=4, dim_y=4,
        cell_x=0.1, cell_y=0.1, mass=0.1, add_springs=True, spring_ke=1e3, spring_kd=1.0,
        tri_ke=1e2, tri_ka=1e2, tri_kd=0.1,
    )
    builder.add_ground_plane(cfg=newton.ModelBuilder.ShapeConfig(ke=1e3, kd=10.0, kf=10.0, mu=0.5))
    model = builder.finalize(device=device, requires_grad=requires_grad)
    model.particle_grid = None  # no particle self-contact: its HashGrid is rebuilt on the host every step
    model.spring_rest_length.assign(model.spring_rest_length.numpy() * 0.8)  # pre-stretched: springs matter
    model.soft_contact_ke, model.soft_contact_kd, model.soft_contact_kf, model.soft_contact_mu = 1e3, 10.0, 10.0, 0.5
    if solver == "xpbd":
        model.particle_max_radius = 0.0  # XPBD's particle-particle contact also needs the host-built grid
        solver = newton.solvers.SolverXPBD(model, iterations=2)
    else:
        solver = newton.solvers.SolverSemiImplicit(model, enable_tri_contact=False)
    pipeline = newton.CollisionPipeline(model, broad_phase="explicit", soft_contact_gap=10.0, requires_grad=requires_grad)
    contacts = pipeline.contacts()
    pipeline.collide(model.state(), contacts)
    return model, solver, contacts


@pytest.fixture(scope="module")
def semi_implicit():
    model, solver, contacts = cloth_scene()
    step = NewtonStep(model, solver, DT, contacts=contacts, control_fields=("particle_f",), param_fields=PARAMS)
    return model, solver, contacts, step


def forces_and_weights(n):
    rng = np.random.default_rng(0)
    forces = rng.normal(size=(T, n, 3)).astype(np.float32) * 0.05
    wq, wv = (rng.normal(size=(n, 3)).astype(np.float32) for _ in range(2))
    return forces, wq, wv


def newton_loop(model, solver, contacts, forces=None, steps=T):
    states = [model.state(requires_grad=model.requires_grad) for _ in range(steps + 1)]
    for t in range(steps):
        if forces is None:
            states[t].clear_forces()
        else:
            states[t].particle_f.assign(forces[t])
        solver.step(states[t], states[t + 1], None, contacts, DT)
    return states


def test_forward_equals_newton(semi_implicit):
    model, solver, contacts, step = semi_implicit
    forces, _, _ = forces_and_weights(model.particle_count)
    final, trajectory = jax.jit(lambda s, f, p: rollout(step, s, {"particle_f": f}, p))(
        step.initial_state(), jnp.asarray(forces), step.initial_params()
    )
    states = newton_loop(model, solver, contacts, forces)
    assert np.abs(np.asarray(final["particle_q"]) - states[T].particle_q.numpy()).max() <= 1e-6
    assert np.abs(np.asarray(trajectory["particle_q"][T // 2 - 1]) - states[T // 2].particle_q.numpy()).max() <= 1e-6
    assert states[T].particle_q.numpy()[:, 2].min() > 0.09  # free fall would reach 0.02: the ground held it


def test_unrolled_rollout_equals_the_plain_one(semi_implicit):
    model, _, _, step = semi_implicit
    forces = jnp.asarray(forces_and_weights(model.particle_count)[0])
    run = lambda unroll: jax.jit(lambda s, f, p: rollout(step, s, {"particle_f": f}, p, unroll=unroll))(  # noqa: E731
        step.initial_state(), forces, step.initial_params())
    (final, trajectory), (final_4, trajectory_4) = run(1), run(4)  # T = 100: 25 iterations of 4 steps
    jax.tree.map(np.testing.assert_array_equal, (final_4, trajectory_4), (final, trajectory))


@wp.kernel
def weighted_sum(q: wp.array(dtype=wp.vec3), qd: wp.array(dtype=wp.vec3), wq: wp.array(dtype=wp.vec3),
                 wv: wp.array(dtype=wp.vec3), out: wp.array(dtype=float)):
    i = wp.tid()
    wp.atomic_add(out, 0, wp.dot(q[i], wq[i]) + wp.dot(qd[i], wv[i]))


def relative_error(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_gradients_equal_tape_and_finite_differences(semi_implicit):
    model, solver, contacts, step = semi_implicit
    forces, wq, wv = forces_and_weights(model.particle_count)

    def loss(state, forces, params):
        final, _ = rollout(step, state, {"particle_f": forces}, params, checkpoint=True)
        return (final["particle_q"] * wq).sum() + (final["particle_qd"] * wv).sum()

    s0, p0 = step.initial_state(), step.initial_params()
    grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    value, (g_state, g_forces, g_params) = jax.block_until_ready(grad_fn(s0, jnp.asarray(forces), p0))

    # Newton's own differentiable path: wp.Tape over the same rollout. Warp's tape is one per process, and JAX
    # runs the call above asynchronously: it must have finished before the tape starts recording (on the H200,
    # under pytest-xdist, the tape once lost a scope: "ended tape scope, but scope not present").
    m2, s2, c2 = cloth_scene(requires_grad=True)
    states = [m2.state(requires_grad=True) for _ in range(T + 1)]
    for t in range(T):
        states[t].particle_f.assign(forces[t])
    # Every array on the model's device (the CPU): Warp's default device on a GPU host is CUDA, and Warp 1.19
    # launches a CUDA kernel on host arrays without a word (an illegal memory access).
    device = m2.device
    out = wp.zeros(1, dtype=float, requires_grad=True, device=device)
    tape = wp.Tape()
    with tape:
        for t in range(T):
            s2.step(states[t], states[t + 1], None, c2, DT)
        wp.launch(weighted_sum, m2.particle_count, inputs=[states[T].particle_q, states[T].particle_qd,
                  wp.array(wq, dtype=wp.vec3, device=device), wp.array(wv, dtype=wp.vec3, device=device)],
                  outputs=[out], device=device)
    tape.backward(out)
    assert abs(float(value) - out.numpy()[0]) <= 1e-5 * abs(out.numpy()[0])
    assert relative_error(g_state["particle_qd"], states[0].particle_qd.grad.numpy()) <= 1e-5
    assert relative_error(g_state["particle_q"], states[0].particle_q.grad.numpy()) <= 1e-5
    assert relative_error(g_forces, np.stack([states[t].particle_f.grad.numpy() for t in range(T)])) <= 1e-5
    for name in PARAMS:
        assert relative_error(g_params[name], getattr(m2, name).grad.numpy()) <= 1e-5, name

    # central differences of the float32 rollout along one direction per argument (float64 is not an option:
    # Newton's kernels are float32)
    rng = np.random.default_rng(1)
    loss_jit = jax.jit(loss)
    cases = {
        "initial velocity": (lambda e: ({**s0, "particle_qd": s0["particle_qd"] + e}, forces, p0), g_state["particle_qd"], 1e-3),
        "forces": (lambda e: (s0, forces + e, p0), g_forces, 1e-3),
        "spring stiffness": (lambda e: (s0, forces, {**p0, "spring_stiffness": p0["spring_stiffness"] + e}), g_params["spring_stiffness"], 2.0),
    }
    for name, (perturbed, grad, scale) in cases.items():
        direction = jnp.asarray(rng.normal(size=grad.shape).astype(np.float32)) * scale
        fd = (loss_jit(*perturbed(direction)) - loss_jit(*perturbed(-direction))) / 2
        analytic = float((grad * direction).sum())
        assert abs(float(fd) - analytic) <= 2e-2 * abs(analytic), (name, float(fd), analytic)


def test_vmap_equals_per_element(semi_implicit):
    _, _, _, step = semi_implicit
    s0, p0 = step.initial_state(), step.initial_params()
    velocities = jnp.stack([s0["particle_qd"] + d for d in (0.0, 0.2, -0.3)])
    forces = jnp.zeros((20, *s0["particle_q"].shape))

    def run(qd):
        return rollout(step, {**s0, "particle_qd": qd}, {"particle_f": forces}, p0)[0]["particle_q"]

    batched = jax.jit(jax.vmap(run))(velocities)
    for b in range(3):
        np.testing.assert_allclose(batched[b], jax.jit(run)(velocities[b]), rtol=0, atol=1e-7)


def test_modules_train_parameters(semi_implicit):
    _, _, _, step = semi_implicit
    s0 = step.initial_state()
    zero = {"particle_f": jnp.zeros_like(s0["particle_q"])}
    module = nnx_module(step)
    direct = step(s0, zero, step.initial_params())
    np.testing.assert_array_equal(module(s0, zero)["particle_q"], direct["particle_q"])
    eqx_module = equinox_module(step)
    grads = jax.grad(lambda m: eqx_module.__class__(m, step)(s0, zero)["particle_qd"].sum())(eqx_module.params)
    assert set(grads) == set(PARAMS)


def test_xpbd_forward_equals_newton():
    model, solver, contacts = cloth_scene(solver="xpbd")
    step = NewtonStep(model, solver, DT, contacts=contacts)
    final, _ = jax.jit(lambda s: rollout(step, s, None, num_steps=T))(step.initial_state())
    states = newton_loop(model, solver, contacts)
    # XPBD accumulates constraint corrections with atomics: bit for bit Newton's loop on one CPU thread; with
    # launches forced onto several (WARPNN_CPU_MIN_WORK=1) the per-thread partial sums add in another order.
    threads, min_work = _batched.cpu_thread_config()
    tolerance = 1e-6 if threads == 1 or min_work >= model.particle_count else 1e-5
    assert np.abs(np.asarray(final["particle_q"]) - states[T].particle_q.numpy()).max() <= tolerance
    # Each kernel of the step against Warp running it (tests/test_differential.py), with CPU threads on too: 5
    # kernels, all compared forward and in vmap; the spring and bending constraints accumulate their multipliers in
    # place and read them back in the same launch: refused in reverse mode, the other 3 compared.
    counts, failures = run_program(step.program, step.program.initial_inputs(), cpu_threads=True)
    assert failures == [], failures
    assert counts["launches"] == 5 and counts["vmap compared"] == 5, counts
    assert counts["reverse compared"] == 3 and counts["reverse refused (named)"] == 2, counts
    assert counts["CPU threads compared"] == 3 or jax.default_backend() != "cpu", counts


def test_refusals_are_clear():
    model, solver, contacts = cloth_scene()
    with pytest.raises(TypeError, match=r"soft_contact_ke is a float.*shape_material_ke"):
        NewtonStep(model, solver, DT, contacts=contacts, param_fields=("soft_contact_ke",))
    model, solver, contacts = cloth_scene()
    model.particle_grid = wp.HashGrid(8, 8, 8, device="cpu")  # particle self-contact on: rebuilt every step
    with pytest.raises(RuntimeError, match="HashGrid.build"):
        NewtonStep(model, solver, DT, contacts=contacts)


@pytest.mark.gpu
def test_rollout_replays_from_cuda_graphs():
    """On CUDA, XLA replays the scan body (every Newton launch and adjoint) from CUDA graphs, default flags."""
    from warpnn import _launch

    model, solver, contacts = cloth_scene(device="cuda:0")
    step = NewtonStep(model, solver, DT, contacts=contacts, param_fields=PARAMS)

    def loss(state, params):
        final, _ = rollout(lambda s, c, p: step(s, None, p), state, None, params, num_steps=T)
        return final["particle_q"].sum()

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    gpu = jax.devices("gpu")[0]
    args = jax.device_put((step.initial_state(), step.initial_params()), gpu)
    for _ in range(3):
        jax.block_until_ready(grad(*args))
    before = sum(_launch.LAUNCHER.handler_entries.values())
    for _ in range(10):
        jax.block_until_ready(grad(*args))
    launches = 10 * T * 2 * step.program.num_launches  # forward and adjoint of each launch, every step
    per_launch = (sum(_launch.LAUNCHER.handler_entries.values()) - before) / launches
    assert per_launch < 0.1, per_launch


def pendulum_chain(links=3):
    """A chain of revolute joints (Featherstone's generalized coordinates), swinging under gravity."""
    builder = newton.ModelBuilder()
    joints, parent = [], -1
    for i in range(links):
        link = builder.add_link(xform=wp.transform(wp.vec3(0.0, 0.0, -0.5 * i), wp.quat_identity()), mass=1.0,
                                inertia=wp.mat33(np.eye(3) * 0.05))
        builder.add_shape_capsule(link, radius=0.05, half_height=0.2)
        offset = wp.vec3(0.0, 0.0, -0.5 if parent >= 0 else 0.0)
        joints.append(builder.add_joint_revolute(parent, link, parent_xform=wp.transform(offset, wp.quat_identity()),
                                                 child_xform=wp.transform_identity(), axis=wp.vec3(0.0, 1.0, 0.0)))
        parent = link
    builder.add_articulation(joints)
    model = builder.finalize(device="cpu")
    state = model.state()
    state.joint_qd.assign(np.array([0.5, -0.3, 0.2][:links], dtype=np.float32))
    newton.eval_fk(model, state.joint_q, state.joint_qd, state)
    return model, newton.solvers.SolverFeatherstone(model), state


def replay_and_newtons_loop(model, solver, start, step, fields, steps):
    """``step``'s rollout of ``steps`` from ``start`` and Newton's own loop over them: the initial state pytree,
    the replay's final state and Newton's final ``State``."""
    state0 = {k: jnp.asarray(getattr(start, k).numpy()) for k in fields}
    final, _ = jax.jit(lambda s: rollout(step, s, None, num_steps=steps))(state0)
    states = [model.state() for _ in range(steps + 1)]
    for k in fields:
        getattr(states[0], k).assign(getattr(start, k))
    for t in range(steps):
        states[t].clear_forces()
        solver.step(states[t], states[t + 1], None, None, DT)
    return state0, final, states[steps]


def test_featherstone_forward_equals_newton_and_reverse_is_refused():
    model, solver, start = pendulum_chain()
    fields = ("joint_q", "joint_qd", "body_q", "body_qd")
    step = NewtonStep(model, solver, DT, state_fields=fields)
    state0, final, newtons = replay_and_newtons_loop(model, solver, start, step, fields, T)
    for k in ("joint_q", "body_q"):
        assert np.abs(np.asarray(final[k]) - getattr(newtons, k).numpy()).max() <= 1e-6, k
    assert np.abs(newtons.joint_q.numpy()).max() > 1e-3  # it moved
    # Its forward-kinematics kernels read elements other threads of the launch write: the bridge refuses to
    # differentiate them rather than return a wrong gradient (a tape over many steps is off, see NEWTON-FACTS).
    with pytest.raises(TypeError, match="cannot be differentiated"):
        jax.grad(lambda qd: rollout(step, {**state0, "joint_qd": qd}, None, num_steps=2)[0]["joint_q"].sum())(state0["joint_qd"])


def test_featherstone_default_state_carries_the_joint_fields_it_writes():
    """Featherstone steps joint_q / joint_qd and reads them back: the default state carries them (before, only
    body_q / body_qd were carried and every replayed step restarted from the trace-time joints)."""
    model, solver, start = pendulum_chain()
    step = NewtonStep(model, solver, DT)
    assert {"joint_q", "joint_qd", "body_q", "body_qd"} <= set(step.state_fields)
    with pytest.raises(ValueError, match=r"joint_q.*not in state_fields"):
        NewtonStep(model, solver, DT, state_fields=("body_q", "body_qd"))


def test_tracing_leaves_the_solver_counter_and_refuses_a_counter_the_launches_depend_on():
    model, solver, start = pendulum_chain()
    before = solver._step
    NewtonStep(model, solver, DT)
    assert solver._step == before  # the caller's own loop continues where it was
    every_other = newton.solvers.SolverFeatherstone(model, update_mass_matrix_interval=2)
    with pytest.raises(RuntimeError, match=r"changed Python state.*_step"):
        NewtonStep(model, every_other, DT)
    assert every_other._step == 0


def test_featherstone_with_tile_gemm_forward_equals_newton():
    """use_tile_gemm=True launches with wp.launch_tiled, which the tracer froze at its trace-time result before it
    recorded at Warp's launch core."""
    if jax.default_backend() == "gpu":
        pytest.skip("the chain is built on Warp's CPU device, and the GPU machine's Warp lacks libmathdx for CPU tiles")
    model, _, start = pendulum_chain()
    solver = newton.solvers.SolverFeatherstone(model, use_tile_gemm=True)
    step = NewtonStep(model, solver, DT)
    fields = step.state_fields
    assert any(launch.block_dim for launch in step.program.launches())  # the tiled launches are recorded
    _, final, newtons = replay_and_newtons_loop(model, solver, start, step, fields, T)
    for k in ("joint_q", "body_q"):
        assert np.abs(np.asarray(final[k]) - getattr(newtons, k).numpy()).max() <= 1e-5, k
    assert np.abs(newtons.joint_q.numpy()).max() > 1e-3


@pytest.mark.slow  # (~40 s on 2 cores: the suite keeps under 10 minutes on CI; pytest --slow runs it)
def test_mujoco_solver_forward_equals_newton_and_reverse_is_refused_with_the_reasons():
    """Newton's SolverMuJoCo (mujoco_warp's step between Newton's coordinate conversions and forward kinematics)
    traced: the replay equals Newton's own loop (measured 0.0), and reverse mode is refused naming what has no
    right per-kernel adjoint (the constraint solver's wp.capture_while, Newton's articulation FK), never a gradient
    through them. (Gradients through mujoco_warp: warpnn_models.mujoco.MujocoStep, whose stage rules cover both.)"""
    pytest.importorskip("mujoco_warp")
    if jax.default_backend() == "gpu":
        pytest.skip("the chain is built on Warp's CPU device, and the GPU machine's Warp lacks libmathdx for CPU tiles")
    model, _, start = pendulum_chain()
    solver = newton.solvers.SolverMuJoCo(model, use_mujoco_cpu=False)
    fields = ("joint_q", "joint_qd", "body_q", "body_qd")
    step = NewtonStep(model, solver, DT, state_fields=fields)
    state0, final, newtons = replay_and_newtons_loop(model, solver, start, step, fields, 20)
    for k in fields:
        assert np.abs(np.asarray(final[k]) - getattr(newtons, k).numpy()).max() <= 1e-6, k
    assert np.abs(newtons.joint_q.numpy()).max() > 1e-3  # it moved
    refusals = step.program.reverse_refusals()
    assert any(name.startswith("wp.capture_while") for name in refusals), sorted(refusals)
    assert "another thread wrote" in refusals["eval_articulation_fk"]
    with pytest.raises(TypeError, match="cannot be differentiated"):
        jax.grad(lambda qd: rollout(step, {**state0, "joint_qd": qd}, None, num_steps=2)[0]["joint_q"].sum())(
            state0["joint_qd"])


def vbd_cloth():
    """A 5x5 cloth pinned on its left edge, colored for SolverVBD's Gauss-Seidel sweeps (no self-contact)."""
    builder = newton.ModelBuilder()
    builder.add_cloth_grid(pos=wp.vec3(0.0, 0.0, 0.5), rot=wp.quat_identity(), vel=wp.vec3(0.0, 0.0, 0.0), dim_x=4,
                           dim_y=4, cell_x=0.1, cell_y=0.1, mass=0.1, tri_ke=1e2, tri_ka=1e2, tri_kd=0.1, fix_left=True)
    builder.color()
    model = builder.finalize(device="cpu")
    model.particle_grid = None
    return model, newton.solvers.SolverVBD(model, iterations=2, particle_enable_self_contact=False)


def test_vbd_forward_equals_newton():
    """SolverVBD (colored Gauss-Seidel) traced: 20 steps of a pinned cloth equal Newton's own loop (measured 0.0).
    Another solver made after this one sets its own Warp module options, which the VBD step re-applies when it
    first runs (Newton's `_apply_module_options`): a cache flag the trace accepts, not Python state it refuses."""
    model, solver = vbd_cloth()
    cloth_scene(solver="xpbd")
    step = NewtonStep(model, solver, DT)
    final, _ = jax.jit(lambda s: rollout(step, s, None, num_steps=20))(step.initial_state())
    states = [model.state() for _ in range(21)]
    for t in range(20):
        states[t].clear_forces()
        solver.step(states[t], states[t + 1], None, None, DT)
    assert np.abs(np.asarray(final["particle_q"]) - states[20].particle_q.numpy()).max() <= 1e-6
    assert np.abs(states[20].particle_q.numpy() - states[0].particle_q.numpy()).max() > 1e-3  # it moved
    # Each kernel of the step against Warp running it (tests/test_differential.py): 4, compared forward and in vmap,
    # the elasticity solve with its adjacency struct. 3 compared in reverse mode: `update_velocity`,
    # `apply_truncation_ts`, which writes `pos` in place (`pos_out` is `pos`) behind a null-array test, and the
    # kernel that updates positions in place and reads them back, both proven at trace time to touch only their own
    # particle's elements (warpnn._owned); the elasticity solve stays refused (loops inside a @wp.func whose
    # bounds come from the adjacency, which the launch reads through a struct).
    counts, failures = run_program(step.program, step.program.initial_inputs())
    assert failures == [], failures
    assert counts["launches"] == 4 and counts["vmap compared"] == 4 and counts["struct arguments"] == 1, counts
    assert counts["reverse compared"] == 3 and counts["reverse refused (named)"] == 1, counts
