"""warpnn.trace: recorded Warp functions replayed as JAX, against the same function run by Warp and pure JAX."""

import ctypes
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp

import warpnn
from warpnn._access import codegen_facts
from warpnn._signature import kernel_array_uses

from .helpers import assert_close


@wp.kernel
def spring_force(x: wp.array(dtype=wp.vec3), pairs: wp.array(dtype=wp.vec2i), k: wp.array(dtype=float), f: wp.array(dtype=wp.vec3)):
    s = wp.tid()
    i, j = pairs[s][0], pairs[s][1]
    d = x[j] - x[i]
    wp.atomic_add(f, i, k[s] * d)
    f[j] -= k[s] * d


@wp.kernel
def gravity_force(m: wp.array(dtype=float), g: float, f: wp.array(dtype=wp.vec3)):
    i = wp.tid()
    f[i] += wp.vec3(0.0, 0.0, -g * m[i])


@wp.kernel
def integrate(x: wp.array(dtype=wp.vec3), v: wp.array(dtype=wp.vec3), f: wp.array(dtype=wp.vec3), m: wp.array(dtype=float),
              unused: wp.array(dtype=float), dt: float, x_new: wp.array(dtype=wp.vec3), v_new: wp.array(dtype=wp.vec3)):
    i = wp.tid()
    v1 = v[i] + f[i] / m[i] * dt
    if unused:  # a None array reads as false
        v1 = v1 * unused[i]
    v_new[i] = v1
    x_new[i] = x[i] + v1 * dt


@wp.kernel
def scale_in_place(s: float, a: wp.array(dtype=float)):
    i = wp.tid()
    a[i] = a[i] * s


@wp.kernel
def scale_into(s: float, a: wp.array(dtype=float), b: wp.array(dtype=float)):
    i = wp.tid()
    b[i] = a[i] * s


N, DT, G = 4, 0.01, 9.8
PAIRS = np.array([[0, 1], [1, 2], [2, 3], [3, 0]], dtype=np.int32)


class Springs:
    """A small simulator in Newton's style: Python that launches kernels on arrays it holds."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.x = wp.array(rng.normal(size=(N, 3)), dtype=wp.vec3)
        self.v = wp.array(rng.normal(size=(N, 3)) * 0.1, dtype=wp.vec3)
        self.x_new, self.v_new = wp.zeros(N, dtype=wp.vec3), wp.zeros(N, dtype=wp.vec3)
        self.f = wp.zeros(N, dtype=wp.vec3)
        self.k = wp.array(np.linspace(1.0, 2.0, len(PAIRS)), dtype=float)
        self.m = wp.array(np.linspace(1.0, 1.5, N), dtype=float)
        self.pairs = wp.array(PAIRS, dtype=wp.vec2i)

    def step(self):
        self.f.zero_()
        wp.launch(spring_force, len(PAIRS), inputs=[self.x, self.pairs, self.k], outputs=[self.f])
        wp.launch(gravity_force, N, inputs=[self.m, G], outputs=[self.f])
        f_copy = wp.clone(self.f)
        wp.launch(integrate, N, inputs=[self.x, self.v, f_copy, self.m, None, DT], outputs=[self.x_new, self.v_new])


def step_reference(x, v, k, m):
    d = x[PAIRS[:, 1]] - x[PAIRS[:, 0]]
    f = jnp.zeros_like(x).at[PAIRS[:, 0]].add(k[:, None] * d).at[PAIRS[:, 1]].add(-k[:, None] * d)
    f = f + jnp.stack([jnp.zeros(N), jnp.zeros(N), -G * m], axis=1)
    v1 = v + f / m[:, None] * DT
    return x + v1 * DT, v1


def traced_springs():
    sim = Springs()
    program = warpnn.trace(sim.step, inputs={"x": sim.x, "v": sim.v, "k": sim.k}, outputs={"x": sim.x_new, "v": sim.v_new})
    return sim, program


def test_kernel_array_uses_classifies_writes():
    uses = kernel_array_uses(spring_force)
    assert uses["f"].writes and not uses["f"].reads and {a.kind for a in uses["f"].accesses} == {"accumulate"}
    assert uses["x"].reads and not uses["x"].writes
    uses = kernel_array_uses(integrate)
    assert uses["v_new"].writes and not uses["v_new"].reads
    assert not uses["unused"].writes  # `if unused:` tests for a null array only
    uses = kernel_array_uses(scale_in_place)["a"]
    assert uses.reads and uses.writes


def test_in_place_kernel_replays_and_differentiates():
    a = wp.array(np.arange(4.0), dtype=float)
    b = wp.zeros(4, dtype=wp.vec3)

    def fn():
        wp.launch(scale_in_place, 4, inputs=[3.0, a])
        wp.launch(gravity_force, 4, inputs=[a, 1.0], outputs=[b])

    program = warpnn.trace(fn, inputs={"a": a}, outputs={"a": a, "b": b})
    assert "a updated" in program.describe()
    x = jnp.linspace(1.0, 2.0, 4)
    out = program({"a": x})
    assert_close(out["a"], 3 * x)
    assert_close(out["b"][:, 2], -3 * x)
    grad = jax.grad(lambda x: (program({"a": x})["a"] ** 2).sum() + program({"a": x})["b"].sum())(x)
    assert_close(grad, 18 * x - 3)


def test_replay_equals_warp_and_pure_jax():
    sim, program = traced_springs()
    assert program.num_launches == 3
    x0, v0, k = (jnp.asarray(a.numpy()) for a in (sim.x, sim.v, sim.k))
    out = jax.jit(program)({"x": x0, "v": v0, "k": k})
    sim.step()  # Warp itself, on the same (restored) arrays
    assert_close(out["x"], sim.x_new.numpy(), rtol=1e-6, atol=1e-7)
    assert_close(out["v"], sim.v_new.numpy(), rtol=1e-6, atol=1e-7)
    xr, vr = step_reference(x0, v0, k, jnp.asarray(sim.m.numpy()))
    assert_close(out["x"], xr, rtol=1e-6, atol=1e-7)


def test_tracing_changes_no_caller_data():
    sim = Springs()
    before = {n: getattr(sim, n).numpy().copy() for n in ("x", "v", "f", "x_new", "v_new")}
    warpnn.trace(sim.step, inputs={"x": sim.x, "v": sim.v, "k": sim.k}, outputs={"x": sim.x_new})
    for n, value in before.items():
        np.testing.assert_array_equal(getattr(sim, n).numpy(), value, err_msg=n)


def test_grad_scan_vmap_checkpoint_against_pure_jax():
    sim, program = traced_springs()
    x0, v0, k = (jnp.asarray(a.numpy()) for a in (sim.x, sim.v, sim.k))
    m = jnp.asarray(sim.m.numpy())

    def rollout(step, x, v, k):
        def body(carry, _):
            return jax.checkpoint(step)(*carry, k), None

        (x, v), _ = jax.lax.scan(body, (x, v), None, length=20)
        return (x**2).sum() + (v * jnp.arange(3.0)).sum()

    def warp_step(x, v, k):
        out = program({"x": x, "v": v, "k": k})
        return out["x"], out["v"]

    def ref_step(x, v, k):
        return step_reference(x, v, k, m)

    grads = jax.jit(jax.grad(rollout, argnums=(1, 2, 3)), static_argnums=0)
    for got, want in zip(grads(warp_step, x0, v0, k), grads(ref_step, x0, v0, k)):
        assert_close(got, want, rtol=1e-5, atol=1e-6)
    xs = jnp.stack([x0, 1.1 * x0, 0.9 * x0])
    batched = jax.jit(jax.vmap(lambda x: program({"x": x, "v": v0, "k": k})["x"]))(xs)
    for b in range(3):
        assert_close(batched[b], program({"x": xs[b], "v": v0, "k": k})["x"], rtol=1e-6, atol=1e-7)


def test_copy_and_fill_replay():
    a = wp.array(np.arange(6.0), dtype=float)
    b = wp.zeros(8, dtype=float)
    c = wp.zeros(3, dtype=float)

    def fn():
        b.fill_(2.0)
        wp.copy(b, a, dest_offset=1, src_offset=2, count=3)
        c.assign(a[:3] if False else wp.array([7.0, 8.0, 9.0], dtype=float))

    program = warpnn.trace(fn, inputs={"a": a}, outputs={"b": b, "c": c})
    out = program({"a": jnp.arange(6.0) * 10})
    np.testing.assert_array_equal(out["b"], [2, 20, 30, 40, 2, 2, 2, 2])
    np.testing.assert_array_equal(out["c"], [7, 8, 9])


def test_refuses_host_reads():
    sim = Springs()

    def fn():
        if sim.k.numpy()[0] > 0:  # data-dependent host control flow
            sim.step()

    with pytest.raises(RuntimeError, match="read array data to the host"):
        warpnn.trace(fn, inputs={"k": sim.k}, outputs={"x": sim.x_new})


def test_refuses_host_rebuilds_unless_frozen():
    grid = wp.HashGrid(4, 4, 4)
    points = wp.array(np.random.default_rng(0).random((16, 3)), dtype=wp.vec3)
    out = wp.zeros(16, dtype=wp.vec3)

    def fn():
        grid.build(points, 0.1)
        wp.copy(out, points)

    with pytest.raises(RuntimeError, match=r"HashGrid.build.*frozen_host_ops=True"):
        warpnn.trace(fn, inputs={"p": points}, outputs={"o": out})
    program = warpnn.trace(fn, inputs={"p": points}, outputs={"o": out}, frozen_host_ops=True)
    assert_close(program({"p": jnp.ones((16, 3))})["o"], np.ones((16, 3)))


@wp.kernel
def scaled_copy(a: wp.array(dtype=float), b: wp.array(dtype=float), s: float):
    i = wp.tid()
    b[i] = a[i] * s


@wp.kernel
def scale_positive(a: wp.array(dtype=float), b: wp.array(dtype=float), s: float):
    i = wp.tid()
    if a[i] > 0.0:
        b[i] = a[i] * s


def test_scalars_after_written_arrays_replay():
    a = wp.array(np.array([1.0, -2.0, 3.0, -4.0]), dtype=float)
    b = wp.array(np.full(4, 7.0), dtype=float)
    c = wp.array(np.full(4, 5.0), dtype=float)

    def fn():
        wp.launch(scaled_copy, 4, inputs=[a, b, 2.0])  # b: a pure output, before the scalar
        wp.launch(scale_positive, 4, inputs=[a, c, 3.0])  # c: in-out (stored under a condition), before the scalar

    program = warpnn.trace(fn, inputs={"a": a}, outputs={"b": b, "c": c})
    assert program.describe().splitlines() == ["launch scaled_copy dims (4,): b =", "launch scale_positive dims (4,): b updated"]
    x = jnp.array([2.0, -1.0, 0.5, 4.0])
    out = jax.jit(program)({"a": x})
    assert_close(out["b"], 2 * x)
    assert_close(out["c"], jnp.where(x > 0, 3 * x, 5.0))
    grad = jax.grad(lambda x: (program({"a": x})["b"] * program({"a": x})["c"]).sum())(x)
    assert_close(grad, jnp.where(x > 0, 12 * x, 10.0))


@wp.kernel
def integrate_active(x: wp.array(dtype=wp.vec3), v: wp.array(dtype=wp.vec3), active: wp.array(dtype=int), dt: float,
                     x_new: wp.array(dtype=wp.vec3), v_new: wp.array(dtype=wp.vec3)):
    # Newton's integrate_particles pattern: x_new is stored on every path, v_new only for active particles.
    i = wp.tid()
    x0 = x[i]
    if active[i] == 0:
        x_new[i] = x0
        return
    v1 = v[i] + wp.vec3(0.0, 0.0, -9.8) * dt
    x_new[i] = x0 + v1 * dt * v1[2]
    v_new[i] = v1


def test_array_stored_whole_before_an_in_out_one_is_a_pure_output(monkeypatch):
    rng = np.random.default_rng(3)
    x = wp.array(rng.normal(size=(N, 3)), dtype=wp.vec3, requires_grad=True)
    v = wp.array(rng.normal(size=(N, 3)), dtype=wp.vec3, requires_grad=True)
    active = wp.array(np.array([1, 0, 1, 1]), dtype=int)
    x_new = wp.array(rng.normal(size=(N, 3)), dtype=wp.vec3, requires_grad=True)
    v_new = wp.array(rng.normal(size=(N, 3)), dtype=wp.vec3, requires_grad=True)
    stale_v = v_new.numpy().copy()

    def fn():
        wp.launch(integrate_active, N, inputs=[x, v, active, DT], outputs=[x_new, v_new])

    program = warpnn.trace(fn, inputs={"x": x, "v": v}, outputs={"x": x_new, "v": v_new})
    # x_new moved behind v_new (a reordered kernel), so it needs no operand: no copy of its old value.
    assert program.describe() == "launch integrate_active dims (4,): v_new updated, x_new ="
    x0, v0 = jnp.asarray(x.numpy()), jnp.asarray(v.numpy())
    out = jax.jit(program)({"x": x0, "v": v0})
    tape = wp.Tape()
    with tape:
        fn()
    assert_close(out["x"], x_new.numpy(), rtol=1e-6, atol=1e-7)
    assert_close(out["v"], v_new.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(out["v"])[1], stale_v[1])  # inactive: v_new keeps its old value

    wx, wv = rng.normal(size=(N, 3)), rng.normal(size=(N, 3))
    tape.backward(grads={x_new: wp.array(wx, dtype=wp.vec3), v_new: wp.array(wv, dtype=wp.vec3)})
    loss = lambda x, v: (program({"x": x, "v": v})["x"] * wx).sum() + (program({"x": x, "v": v})["v"] * wv).sum()  # noqa: E731
    gx, gv = jax.grad(loss, argnums=(0, 1))(x0, v0)
    assert_close(gx, x.grad.numpy(), rtol=1e-5, atol=1e-6)
    assert_close(gv, v.grad.numpy(), rtol=1e-5, atol=1e-6)
    monkeypatch.setenv("WARPNN_BATCHED_LAUNCH", "twin")  # the reordered kernel's batched twin, on the CPU too
    xs = x0[None] + jnp.arange(3.0)[:, None, None]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        batched = jax.jit(jax.vmap(lambda x: program({"x": x, "v": v0})))(xs)
    assert not [w for w in record if "launches once per batch element" in str(w.message)]
    for b in range(3):
        single = program({"x": xs[b], "v": v0})
        assert_close(batched["x"][b], single["x"], rtol=1e-6, atol=1e-7)
        assert_close(batched["v"][b], single["v"], rtol=1e-6, atol=1e-7)
    with warpnn.checked():  # checked mode's variant of the reordered kernel
        guarded = jax.jit(lambda x, v: program({"x": x, "v": v}))(x0, v0)
    np.testing.assert_array_equal(np.asarray(guarded["x"]), np.asarray(out["x"]))
    np.testing.assert_array_equal(np.asarray(guarded["v"]), np.asarray(out["v"]))


def test_inputs_checked():
    sim, program = traced_springs()
    with pytest.raises(TypeError, match="missing"):
        program({"x": jnp.zeros((N, 3))})
    with pytest.raises(TypeError, match=r"input 'k' must have shape \(4,\)"):
        program({"x": jnp.zeros((N, 3)), "v": jnp.zeros((N, 3)), "k": jnp.zeros(5)})


def test_constants_as_arguments_keep_them_out_of_the_program():
    sim, program = traced_springs()
    x0, v0, k = (jnp.asarray(a.numpy()) for a in (sim.x, sim.v, sim.k))
    constants = program.constants()
    assert any(name.endswith(":pairs") for name in constants) and not any(name.endswith(":x") for name in constants)
    embedded = jax.jit(lambda x: program({"x": x, "v": v0, "k": k})["x"])
    passed = jax.jit(lambda x, c: program({"x": x, "v": v0, "k": k}, constants=c)["x"])
    np.testing.assert_array_equal(embedded(x0), passed(x0, constants))
    moved = {n: (c + 1.0 if n.endswith(":m") else c) for n, c in constants.items()}  # other masses: other result
    assert not np.allclose(passed(x0, moved), passed(x0, constants))
    with pytest.raises(TypeError, match="constants must be exactly"):
        program({"x": x0, "v": v0, "k": k}, constants={})


@wp.kernel
def double_where_positive(x: wp.array(dtype=float), out: wp.array(dtype=float)):
    i = wp.tid()
    if x[i] > 0.0:
        out[i] = 2.0 * x[i]  # a conditional store: elements not stored keep what the array held


@pytest.mark.parametrize("written_before", [False, True])
def test_a_buffer_allocated_inside_the_call_replays_as_zeros_unless_something_wrote_it(written_before):
    """``wp.empty`` inside the traced call holds unspecified values; the trace makes them zeros and the replay
    builds zeros in the program (no literal, so XLA does not copy one before each in-place write). The replay
    trusts the bytes seen, not the allocation: bytes written by means the tracer does not record stay a
    constant with those values."""
    x, out = wp.array(np.float32([1.0, -2.0, 3.0, -4.0]), device="cpu"), wp.zeros(4, dtype=float, device="cpu")

    def step():
        scratch = wp.empty(4, dtype=float, device="cpu")
        if written_before:
            ctypes.memset(scratch.ptr, 0x3F, scratch.capacity)  # every float 0x3F3F3F3F
        wp.launch(double_where_positive, 4, [x], [scratch], device="cpu")
        wp.copy(out, scratch)

    program = warpnn.trace(step, {"x": x}, {"out": out})
    x1 = jnp.float32([-1.0, 5.0, -6.0, 0.5])
    unset = np.frombuffer(b"\x3f" * 4, np.float32)[0] if written_before else 0.0
    assert_close(jax.jit(lambda x: program({"x": x}))(x1)["out"], np.where(x1 > 0, 2 * x1, unset), rtol=0, atol=0)
    consts = jax.make_jaxpr(lambda x: program({"x": x}))(x1).consts
    assert any(np.shape(c) == (4,) for c in consts) == written_before
    assert len(program.constants()) == int(written_before)


@wp.kernel
def blend(x: wp.array(dtype=float), alpha: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = x[i] * alpha[i] + wp.sin(x[i])  # (an elementwise pair: y may be written over x's or alpha's buffer)


def test_an_output_is_written_over_an_input_only_where_nothing_later_reads_that_input():
    """A pure output ``y[i] = f(x[i])`` may share ``x``'s buffer, but where a later launch still reads ``x`` XLA
    then copies ``x`` first: a copy per step of a rollout that writing ``y`` to a buffer of its own does not
    make. The replay knows the program's later reads (6 of the 18 copies per step of a 7-dof mujoco_warp arm)."""
    n = 8
    x, alpha, y, z = (wp.array(np.linspace(0.1, 1.0, n).astype(np.float32) * (k + 1)) for k in range(4))

    def step():
        wp.launch(blend, n, [x, alpha], [y])
        wp.launch(blend, n, [y, x], [z])  # x read again

    program = warpnn.trace(step, {"x": x, "alpha": alpha}, {"z": z})
    fn = jax.jit(lambda x, a: program({"x": x, "alpha": a})["z"])
    xs, a = jnp.linspace(0.0, 1.0, n), jnp.linspace(1.0, 2.0, n)
    blend_ref = lambda x, a: x * a + jnp.sin(x)  # noqa: E731
    assert_close(fn(xs, a), blend_ref(blend_ref(xs, a), xs), rtol=1e-6)
    hlo = fn.lower(xs, a).compile().as_text()
    assert " copy(" not in hlo
    assert hlo.count("output_to_operand_aliasing") == 1  # (z over y or x: neither is read after the second launch)


@wp.kernel
def offset_scale(x: wp.array(dtype=float), offset: wp.array(dtype=float), out: wp.array(dtype=float)):
    i = wp.tid()
    out[i] += x[i] + offset[i]


def test_a_zero_constant_nothing_writes_stays_a_constant():
    """A zero array the program writes (a scratch buffer zeroed in the step) replays as zeros built in the program,
    which XLA fills in place; one it only reads stays a constant: built inside a rollout's loop, XLA would fill it
    again every step (it does not hoist broadcasts out of loops)."""
    x, offset, out = wp.array(np.float32([1.0, -2.0, 3.0])), wp.zeros(3, dtype=float), wp.zeros(3, dtype=float)

    def step():
        scratch = wp.zeros(3, dtype=float)
        wp.launch(offset_scale, 3, [x, offset], [scratch])
        wp.copy(out, scratch)

    program = warpnn.trace(step, {"x": x}, {"out": out})
    xs = jnp.float32([0.5, 1.5, -2.5])
    assert_close(program({"x": xs})["out"], xs, rtol=0, atol=0)
    assert [name.split(":")[1] for name in program.constants()] == ["offset"]
    assert_close(program({"x": xs}, constants={n: v + 1 for n, v in program.constants().items()})["out"], xs + 1)


@wp.struct
class Spring:
    k: wp.array(dtype=float)
    scale: float


@wp.kernel
def struct_force(x: wp.array(dtype=float), spring: Spring, f: wp.array(dtype=float)):
    i = wp.tid()
    f[i] = -spring.scale * spring.k[i] * x[i]


def test_struct_arguments_replay_and_differentiate():
    x, f = wp.array(np.linspace(0.0, 1.0, 5), dtype=float), wp.zeros(5, dtype=float)
    spring = Spring()
    spring.k, spring.scale = wp.array(np.linspace(1.0, 2.0, 5), dtype=float), 3.0
    program = warpnn.trace(lambda: wp.launch(struct_force, 5, inputs=[x, spring], outputs=[f]),
                           inputs={"x": x, "k": spring.k}, outputs={"f": f})
    xs, k = jnp.linspace(1.0, 2.0, 5), jnp.full(5, 0.5)
    assert_close(program({"x": xs, "k": k})["f"], -1.5 * xs)
    assert_close(jax.grad(lambda k: program({"x": xs, "k": k})["f"].sum())(k), -3.0 * xs)


def test_without_a_reordered_kernel_a_pure_output_before_an_in_out_one_stays_in_out(monkeypatch):
    # Where the kernel cannot be regenerated with its parameters reordered, x_new stays an in-out array (its old
    # value passed in and fully overwritten): slower, and exactly as right.
    from warpnn import _tracer

    def no_source(kernel, order):
        raise OSError("no source")

    monkeypatch.setattr(_tracer, "with_parameters_reordered", no_source)
    rng = np.random.default_rng(5)
    x, v = (wp.array(rng.normal(size=(N, 3)), dtype=wp.vec3) for _ in range(2))
    x_new, v_new = (wp.array(rng.normal(size=(N, 3)), dtype=wp.vec3) for _ in range(2))
    active = wp.array(np.array([1, 1, 0, 1]), dtype=int)

    def fn():
        wp.launch(integrate_active, N, inputs=[x, v, active, DT], outputs=[x_new, v_new])

    program = warpnn.trace(fn, inputs={"x": x, "v": v}, outputs={"x": x_new, "v": v_new})
    assert program.describe() == "launch integrate_active dims (4,): x_new updated, v_new updated"
    out = program({"x": jnp.asarray(x.numpy()), "v": jnp.asarray(v.numpy())})
    fn()
    assert_close(out["x"], x_new.numpy(), rtol=1e-6, atol=1e-7)
    assert_close(out["v"], v_new.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not wp.is_cuda_available(), reason="needs a CUDA device next to the CPU")
def test_launch_over_arrays_of_another_device_is_refused_before_it_runs():
    # wp.launch without device= runs on Warp's default device (CUDA here) whatever the arrays' devices; over host
    # arrays that is an illegal address on the GPU. The trace refuses it before Warp launches anything.
    a, b = wp.zeros(4, dtype=float, device="cpu"), wp.zeros(4, dtype=float, device="cpu")
    with wp.ScopedDevice("cuda:0"):
        with pytest.raises(TypeError, match=r"scaled_copy.*launched on cuda:0.*argument 'a' is an array on cpu.*device='cpu'"):
            warpnn.trace(lambda: wp.launch(scaled_copy, 4, inputs=[a, b, 2.0]), inputs={"a": a}, outputs={"b": b})
    c = wp.zeros(4, dtype=float, device="cuda:0")  # the CUDA context still works
    wp.launch(scaled_copy, 4, inputs=[c, c, 2.0], device="cuda:0")
    wp.synchronize_device("cuda:0")


# --------------------------------------------------------------------------------------------------
# Complete or refuse: launches that went around the recording, control flow, Python state


@wp.kernel
def add_rows_atomically(x: wp.array2d(dtype=float), acc: wp.array2d(dtype=float)):
    w, j = wp.tid()
    wp.atomic_add(acc[w], j, 2.0 * x[w, j])  # the launch's only write goes through a row view


@wp.kernel
def tile_square_rows(x: wp.array2d(dtype=float), out: wp.array2d(dtype=float)):
    i = wp.tid()
    t = wp.tile_load(x[i], shape=8)
    wp.tile_store(out[i], t * t)


def test_a_launch_writing_only_through_a_row_view_is_recorded():
    x, acc = wp.array(np.ones((3, 4), np.float32)), wp.zeros((3, 4), dtype=float)
    program = warpnn.trace(lambda: wp.launch(add_rows_atomically, (3, 4), [x], [acc]), {"x": x}, {"acc": acc})
    assert program.num_launches == 1
    xs = jnp.arange(12.0).reshape(3, 4)
    assert_close(program({"x": xs})["acc"], 2.0 * xs)
    assert_close(jax.grad(lambda x: program({"x": x})["acc"].sum())(xs), 2.0 * np.ones((3, 4)))


def test_launch_tiled_is_recorded_and_replays_new_inputs():
    x, out = wp.array(np.ones((2, 8), np.float32)), wp.zeros((2, 8), dtype=float)
    run = lambda: wp.launch_tiled(tile_square_rows, dim=2, inputs=[x], outputs=[out], block_dim=8)  # noqa: E731
    program = warpnn.trace(run, {"x": x}, {"out": out})
    assert program.num_launches == 1
    xs = jnp.arange(16.0).reshape(2, 8)
    assert_close(program({"x": xs})["out"], xs**2)  # before: the trace-time result (ones), frozen


@wp.kernel
def halve_large(x: wp.array(dtype=float), tol: float, remaining: wp.array(dtype=int)):
    i = wp.tid()
    if wp.abs(x[i]) > tol:
        x[i] = x[i] * 0.5
        wp.atomic_add(remaining, 0, 1)


def halve_until_small(x, remaining):
    remaining.zero_()
    wp.launch(halve_large, x.shape[0], [x, 0.1, remaining])


def test_capture_while_replays_as_a_while_loop_for_any_trip_count():
    """wp.capture_while (mujoco_warp's solver iterates so until every world converged): the body recorded once, the
    replay a lax.while_loop on the condition's value, so an input that needs more iterations than the traced one
    gets them (a frozen count would stop short); under vmap each element runs until its own test is 0."""
    x_np = np.array([1.0, -0.3, 0.05], np.float32)
    x, remaining = wp.array(x_np), wp.zeros(1, dtype=int)

    def step():
        remaining.fill_(1)
        wp.capture_while(remaining, halve_until_small, x=x, remaining=remaining)

    program = warpnn.trace(step, {"x": x}, {"x": x})
    assert "while" in program.describe() and "5 iterations when traced" in program.describe()

    def reference(v):
        v = np.array(v, np.float32)
        while (np.abs(v) > 0.1).any():
            v = np.where(np.abs(v) > 0.1, v * 0.5, v)
        return v

    for v in ([1.0, -0.3, 0.05], [8.0, -0.3, 0.05], [0.01, 0.0, 0.0]):  # 5, 8 and 1 iterations
        assert_close(program({"x": jnp.asarray(v)})["x"], reference(v), rtol=0, atol=0)
        wx, left = wp.array(np.array(v, np.float32)), wp.ones(1, dtype=int)
        wp.capture_while(left, halve_until_small, x=wx, remaining=left)
        assert_close(program({"x": jnp.asarray(v)})["x"], wx.numpy(), rtol=0, atol=0)  # as Warp runs it
    batch = jnp.asarray([[8.0, 1.0, 0.0], [0.2, 0.0, 0.0]])
    assert_close(jax.jit(jax.vmap(lambda v: program({"x": v})["x"]))(batch), np.stack([reference(v) for v in batch]),
                 rtol=0, atol=0)
    # reverse mode: refused by name (a trip count that depends on values); a StageRule around the loop's function
    # is the way (mujoco_warp's solver, tests/test_models_mujoco.py)
    assert list(program.reverse_refusals()) == ["wp.capture_while (operations 1-2)"]
    assert x.numpy().tolist() == x_np.tolist()  # the trace changed nothing


@wp.kernel
def count_large(x: wp.array(dtype=float), tol: float, large: wp.array(dtype=int)):
    i = wp.tid()
    if wp.abs(x[i]) > tol:
        wp.atomic_add(large, 0, 1)


@wp.kernel
def halve_if_any(large: wp.array(dtype=int), tol: float, x: wp.array(dtype=float), remaining: wp.array(dtype=int)):
    i = wp.tid()
    if large[0] > 0 and wp.abs(x[i]) > tol:
        x[i] = x[i] * 0.5
        wp.atomic_add(remaining, 0, 1)


def halve_with_scratch(x, remaining):
    large = wp.zeros(1, dtype=int)  # a scratch array allocated by every iteration (mujoco_warp's line search does)
    wp.launch(count_large, x.shape[0], [x, 0.1, large])
    remaining.zero_()
    wp.launch(halve_if_any, x.shape[0], [large, 0.1, x, remaining])


def test_capture_while_bodies_that_allocate_scratch_arrays_replay_with_the_first_iterations():
    """Each iteration allocates its own scratch array (another address): written whole before it is read, the
    first iteration's stands for every later one's."""
    x, remaining = wp.array(np.array([1.0, -0.3], np.float32)), wp.zeros(1, dtype=int)

    def step():
        remaining.fill_(1)
        wp.capture_while(remaining, halve_with_scratch, x=x, remaining=remaining)

    program = warpnn.trace(step, {"x": x}, {"x": x})
    assert_close(program({"x": jnp.asarray([8.0, 0.05])})["x"], np.float32([0.0625, 0.05]), rtol=0, atol=0)


@wp.kernel
def add_count(remaining: wp.array(dtype=int), total: wp.array(dtype=int)):
    total[0] = total[0] + remaining[0]


def test_capture_while_carries_an_array_the_body_first_touches_from_its_value_before_the_loop():
    """An array that exists before the loop and is first touched inside its body (an accumulator) is no scratch
    buffer: every iteration updates the same array, from its value before the loop."""
    x, remaining, total = wp.array(np.array([1.0, -0.3], np.float32)), wp.zeros(1, dtype=int), wp.array([5], dtype=int)

    def body(x, remaining):
        halve_until_small(x, remaining)
        wp.launch(add_count, 1, [remaining, total])

    def step():
        remaining.fill_(1)
        wp.capture_while(remaining, body, x=x, remaining=remaining)

    program = warpnn.trace(step, {"x": x}, {"x": x, "total": total})
    wx, left, wtotal = wp.array(np.array([8.0, -0.3], np.float32)), wp.ones(1, dtype=int), wp.array([5], dtype=int)
    wp.capture_while(left, lambda: (halve_until_small(wx, left), wp.launch(add_count, 1, [left, wtotal])))
    out = program({"x": jnp.asarray([8.0, -0.3])})
    assert_close(out["x"], wx.numpy(), rtol=0, atol=0)
    assert int(out["total"][0]) == int(wtotal.numpy()[0]) > 5 + 7  # (from 5: the counts of every iteration)


def test_capture_while_bodies_that_change_or_never_run_are_refused():
    x, flag = wp.zeros(4, dtype=float), wp.ones(1, dtype=int)
    calls = []

    def changing_body():  # a second kernel on the second iteration: no one body to replay
        wp.launch(scale_in_place, 4, [2.0, x])
        if calls:
            wp.launch(scale_in_place, 4, [3.0, x])
            flag.zero_()
        calls.append(1)

    with pytest.raises(TypeError, match="iteration 2 of a wp.capture_while recorded other operations"):
        warpnn.trace(lambda: wp.capture_while(flag, changing_body), {"x": x}, {"x": x})
    flag.zero_()
    with pytest.raises(TypeError, match="condition was 0 when traced"):
        warpnn.trace(lambda: wp.capture_while(flag, lambda: x.zero_()), {"x": x}, {"x": x})


def test_data_dependent_control_flow_and_recorded_launch_objects_are_refused():
    a = wp.zeros(4, dtype=float)
    flag = wp.array([1], dtype=int)
    with pytest.raises(RuntimeError, match=r"wp.capture_if"):
        warpnn.trace(lambda: wp.capture_if(flag, lambda: a.zero_()), {"a": a}, {"a": a})
    with pytest.raises(TypeError, match="record_cmd=True"):
        warpnn.trace(lambda: wp.launch(scale_in_place, 4, [2.0, a], record_cmd=True), {"a": a}, {"a": a})
    cmd = wp.launch(scale_in_place, 4, [2.0, a], record_cmd=True)
    with pytest.raises(RuntimeError, match=r"Launch.launch"):
        warpnn.trace(lambda: cmd.launch(), {"a": a}, {"a": a})
    assert flag.numpy()[0] == 1  # nothing changed


class _Stepper:
    def __init__(self):
        self.a = wp.array(np.ones(4, np.float32))
        self.count = 0

    def step(self):
        s = 2.0 if self.count % 2 == 0 else 3.0  # a launch that depends on a Python counter
        wp.launch(scale_in_place, 4, [s, self.a])
        self.count += 1


def test_python_state_changed_by_the_step_is_refused_and_put_back():
    stepper = _Stepper()
    with pytest.raises(RuntimeError, match=r"changed Python state.*count 0 -> 1"):
        warpnn.trace(stepper.step, {"a": stepper.a}, {"a": stepper.a})
    assert stepper.count == 0 and np.allclose(stepper.a.numpy(), 1.0)
    program = warpnn.trace(stepper.step, {"a": stepper.a}, {"a": stepper.a}, python_state=["count"])
    assert stepper.count == 0
    assert_close(program({"a": jnp.ones(4)})["a"], 2.0 * np.ones(4))


class _Swapper:
    """The double-buffer pattern of Warp's examples and Newton's: each step writes one buffer, then swaps names."""

    def __init__(self):
        self.current, self.following = wp.array(np.ones(4, np.float32)), wp.zeros(4, dtype=float)
        self.scratch = None  # allocated on first use

    def step(self):
        if self.scratch is None:
            self.scratch = wp.zeros(4, dtype=float)
        wp.launch(scale_into, 4, [2.0, self.current], [self.following])
        self.current, self.following = self.following, self.current


def test_arrays_swapped_between_attributes_are_refused_and_put_back():
    """Before: a swap went unseen, and the output named `current` (the array object the caller passed) held the
    step's input, silently: the replay looked like a step that does nothing."""
    s = _Swapper()
    current, following = s.current, s.following
    with pytest.raises(RuntimeError, match=r"changed Python state.*s\.current <array of shape \(4,\)"):
        warpnn.trace(lambda: s.step(), {"x": s.current}, {"x": s.current})
    assert s.current is current and s.following is following and s.scratch is not None  # put back; scratch kept
    assert np.allclose(current.numpy(), 1.0) and np.allclose(following.numpy(), 0.0)
    # two swapping steps leave the names as they were: accepted, and the replay is two steps
    program = warpnn.trace(lambda: (s.step(), s.step()), {"x": s.current}, {"x": s.current})
    assert_close(program({"x": jnp.ones(4)})["x"], 4.0 * np.ones(4))


@wp.kernel
def write_then_read_back(x: wp.array(dtype=float), buf_out: wp.array(dtype=float), buf_in: wp.array(dtype=float),
                         y: wp.array(dtype=float)):
    i = wp.tid()
    buf_out[i] = 2.0 * x[i]
    y[i] = buf_in[i] + 1.0  # mujoco_warp's fused linesearch: reads back what it wrote, through another parameter


@wp.kernel
def write_then_read_neighbour(x: wp.array(dtype=float), buf_out: wp.array(dtype=float), buf_in: wp.array(dtype=float),
                              y: wp.array(dtype=float)):
    i = wp.tid()
    buf_out[i] = 2.0 * x[i]
    y[i] = buf_in[(i + 1) % 4] + 1.0


def test_one_array_passed_as_two_parameters_replays_as_warp_runs_it():
    """Before: the replay gave each parameter its own value, so y read the old buffer (mujoco_warp's cart-pole
    drifted 0.09 in qpos from step 24). Now the kernel runs with the parameters merged."""
    x, buf, y = wp.array(np.arange(4.0, dtype=np.float32)), wp.zeros(4, dtype=float), wp.zeros(4, dtype=float)
    program = warpnn.trace(lambda: wp.launch(write_then_read_back, 4, [x, buf, buf], [y]), {"x": x}, {"y": y, "buf": buf})
    wp.launch(write_then_read_back, 4, [x, buf, buf], [y])
    out = program({"x": jnp.arange(4.0)})
    assert_close(out["y"], y.numpy())
    assert_close(out["y"], 2.0 * np.arange(4.0) + 1.0)
    assert_close(out["buf"], 2.0 * np.arange(4.0))
    # each thread reads back only its own element, after its one write of it: proven at trace time, the adjoint
    # replays on the values after the launch (warpnn._owned)
    assert_close(jax.grad(lambda x: program({"x": x})["y"].sum())(jnp.arange(4.0)), 2.0 * np.ones(4))
    # reading back what another thread wrote is beyond Warp's adjoint: refused with the reason, never a wrong gradient
    program = warpnn.trace(lambda: wp.launch(write_then_read_neighbour, 4, [x, buf, buf], [y]), {"x": x}, {"y": y})
    with pytest.raises(TypeError, match="touches an element other than"):
        jax.grad(lambda x: program({"x": x})["y"].sum())(jnp.arange(4.0))


@wp.kernel
def fill_matrices(m: wp.array(dtype=wp.mat33)):
    i = wp.tid()
    m[i] = wp.mat33(float(i), 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0)


@wp.kernel
def sum_rows(rows: wp.array2d(dtype=wp.vec3), total: wp.array(dtype=float)):
    i, r = wp.tid()
    wp.atomic_add(total, i, rows[i, r][0] + rows[i, r][1] + rows[i, r][2])


def test_memory_read_back_as_another_shape_replays_as_a_reshape():
    """mujoco_warp reads its (n,) mat33 contact frames as (n, 3) vec3 through wp.array(ptr=...): one value."""
    m, total = wp.zeros(3, dtype=wp.mat33), wp.zeros(3, dtype=float)
    rows = wp.array(ptr=m.ptr, dtype=wp.vec3, shape=(3, 3), device=m.device)

    def run():
        wp.launch(fill_matrices, 3, [], [m])
        wp.launch(sum_rows, (3, 3), [rows], [total])

    program = warpnn.trace(run, {}, {"total": total})
    run()
    assert_close(program({})["total"], total.numpy())
    assert_close(program({})["total"], np.arange(3.0) + 36.0)


@wp.kernel
def write_matrices_read_rows(m: wp.array(dtype=wp.mat33), rows: wp.array2d(dtype=wp.vec3), t: wp.array(dtype=float)):
    i = wp.tid()
    m[i] = wp.mat33(1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0)
    t[i] = rows[i, 0][0]


def test_one_memory_as_two_shapes_in_one_writing_launch_is_refused():
    m, t = wp.zeros(2, dtype=wp.mat33), wp.zeros(2, dtype=float)
    rows = wp.array(ptr=m.ptr, dtype=wp.vec3, shape=(2, 3), device=m.device)
    with pytest.raises(TypeError, match="different shapes or types over the same memory"):
        warpnn.trace(lambda: wp.launch(write_matrices_read_rows, 2, [m, rows], [t]), {}, {"t": t})


def test_a_program_with_thread_blocks_replays_only_on_the_platform_it_was_traced_on():
    x, out = wp.array(np.ones((2, 8), np.float32), device="cpu"), wp.zeros((2, 8), dtype=float, device="cpu")
    program = warpnn.trace(lambda: wp.launch_tiled(tile_square_rows, dim=2, inputs=[x], outputs=[out], block_dim=8,
                                                   device="cpu"), {"x": x}, {"out": out})
    # as if traced on the other platform than the replay's: refused, not run
    program._platform = "cpu" if jax.default_backend() == "gpu" else "gpu"
    with pytest.raises(TypeError, match="replays only where it was traced"):
        program({"x": jnp.ones((2, 8))})


@wp.kernel
def take_slots(count: wp.array(dtype=int), x: wp.array(dtype=float), out: wp.array(dtype=float)):
    # each thread takes the next free slot (mujoco_warp allocates actuator rows and contacts so)
    i = wp.tid()
    slot = wp.atomic_add(count, 0, 1)
    out[slot] = 2.0 * x[i] * x[i]


def test_slots_taken_with_an_atomic_are_recorded_for_the_adjoint():
    """Warp's adjoint does not run the atomic again (wp.Tape's gradient is wrong here, tests/test_access.py); the
    traced launch records each thread's slot and its adjoint replays on the record (warpnn._recorded)."""
    x_np = np.array([0.5, -1.0, 1.5, 2.0], np.float32)
    count, x, out = wp.zeros(1, dtype=int), wp.array(x_np), wp.zeros(4, dtype=float)
    program = warpnn.trace(lambda: wp.launch(take_slots, 4, [count, x, out]), {"x": x}, {"out": out})
    assert program.reverse_refusals() == {}
    weights = jnp.asarray([1.0, 10.0, 100.0, 1000.0])
    got = program({"x": jnp.asarray(x_np)})["out"]
    thread_of = [int(np.argmin(np.abs(2.0 * x_np * x_np - v))) for v in np.asarray(got)]  # (values are distinct)
    assert sorted(thread_of) == [0, 1, 2, 3]

    def reference(x):
        return (weights * 2.0 * x[jnp.asarray(thread_of)] ** 2).sum()

    grad = jax.jit(jax.grad(lambda x: (weights * program({"x": x})["out"]).sum()))(jnp.asarray(x_np))
    assert_close(grad, jax.grad(reference)(jnp.asarray(x_np)), rtol=1e-5)


@wp.kernel
def list_positive(x: wp.array(dtype=float), count: wp.array(dtype=int), ids: wp.array(dtype=int)):
    # writes integers only, at slots an atomic hands out (mujoco_warp's broadphase lists geom pairs so)
    i = wp.tid()
    if x[i] > 0.0:
        ids[wp.atomic_add(count, 0, 1)] = i


@wp.kernel
def gather_listed(x: wp.array(dtype=float), count: wp.array(dtype=int), ids: wp.array(dtype=int),
                  y: wp.array(dtype=float)):
    j = wp.tid()
    y[j] = wp.where(j < count[0], 3.0 * x[ids[j]] * x[ids[j]], 0.0)


def test_a_launch_that_writes_only_integers_needs_no_adjoint():
    """No cotangent reaches an integer array: the VJP of such a launch is zero whatever its adjoint would do, so
    the atomic slot it uses is no reason to refuse it; the gradient flows through the launch that reads the list."""
    x_np = np.array([0.5, -1.0, 1.5, 2.0], np.float32)
    x, count, ids, y = wp.array(x_np), wp.zeros(1, dtype=int), wp.zeros(4, dtype=int), wp.zeros(4, dtype=float)

    def step():
        wp.launch(list_positive, 4, [x, count, ids])
        wp.launch(gather_listed, 4, [x, count, ids], [y])

    program = warpnn.trace(step, {"x": x}, {"y": y})
    assert program.reverse_refusals() == {}
    weights = jnp.asarray([1.0, 10.0, 100.0, 1000.0])
    listed = np.asarray(program({"x": jnp.asarray(x_np)})["y"])[:3]
    order = [int(np.argmin(np.abs(3.0 * x_np * x_np - v))) for v in listed]  # (the atomic's order: any)
    assert sorted(order) == [0, 2, 3]

    def reference(x):
        return (weights[:3] * 3.0 * x[jnp.asarray(order)] ** 2).sum()

    grad = jax.jit(jax.grad(lambda x: (weights * program({"x": x})["y"]).sum()))(jnp.asarray(x_np))
    assert_close(grad, jax.grad(reference)(jnp.asarray(x_np)), rtol=1e-5)


@wp.func
def damping_force(damping: float, v: float):
    if damping != 0.0:  # (mujoco_warp's passive forces skip a zero damper so)
        return -damping * v
    return 0.0


@wp.kernel
def damped(damping: wp.array(dtype=float), v: wp.array(dtype=float), n: int, f: wp.array(dtype=float)):
    i = wp.tid()
    if i < n:  # (an integer comparison: not listed)
        f[i] = damping_force(damping[i], v[i]) + wp.where(v[i] == 0.0, 1.0, 0.0)


def test_equality_branches_are_listed_where_the_gradient_is_the_side_taken():
    """Warp's adjoint of a float ``==``/``!=`` branch is the derivative off its boundary and the side taken on it:
    the program lists the places, inside ``@wp.func``s too, from Warp's code generator, and reverse mode gives NaN
    where a thread met equality (the equality guard)."""
    damping, v, f = (wp.array(np.zeros(2), dtype=float) for _ in range(3))
    program = warpnn.trace(lambda: wp.launch(damped, 2, inputs=[damping, v, 2], outputs=[f]),
                           inputs={"damping": damping, "v": v}, outputs={"f": f})
    places = program.equality_branches()[damped.key]
    func_line, kernel_line = damping_force.func.__code__.co_firstlineno + 2, damped.func.__code__.co_firstlineno + 4
    assert sorted(places) == [f"'damped' (line {kernel_line}): f[i] = damping_force(damping[i], v[i]) + "
                              "wp.where(v[i] == 0.0, 1.0, 0.0)",
                              f"@wp.func 'damping_force' (line {func_line}): if damping != 0.0:  # (mujoco_warp's "
                              "passive forces skip a zero damper so)"]

    def d_damping(value):
        return jax.grad(lambda d: program({"damping": d, "v": jnp.full(2, 3.0)})["f"].sum())(jnp.full(2, value))

    assert_close(d_damping(0.5), [-3.0, -3.0])  # off the boundary: the derivative (-v)
    assert np.isnan(d_damping(0.0)).all()  # on it: NaN, not the side taken (tests/test_equality_guard.py)
    # the single-kernel bridge's facts are the same
    assert codegen_facts(damped).equality_branches == places
