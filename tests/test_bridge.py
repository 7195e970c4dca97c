"""warpnn.jax_kernel against pure-JAX references: forward, grad, vmap, vmap∘grad, scan, errors."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp
from jax.test_util import check_grads

import warpnn
from warpnn import _launch

from . import kernels_for_tests as K
from .helpers import assert_close

N = 16


@pytest.fixture(scope="module")
def springs_setup():
    return K.springs_case(N)


springs_fn = K.spring_forces_fn


def _vjp_check(f, ref, args, argnums, key, rtol=1e-4, atol=1e-5):
    """Outputs match, and gradients of a random projection of the outputs match, for each argnum."""
    out, ref_out = f(*args), ref(*args)
    jax.tree.map(lambda a, b: assert_close(a, b, rtol, atol), out, ref_out)
    weights = jax.tree.map(lambda o: jax.random.normal(key, o.shape, o.dtype), ref_out)

    def loss(fn):
        return lambda *a: sum(jnp.vdot(w, o) for w, o in zip(jax.tree.leaves(weights), jax.tree.leaves(fn(*a))))

    g = jax.grad(loss(f), argnums)(*args)
    g_ref = jax.grad(loss(ref), argnums)(*args)
    jax.tree.map(lambda a, b: assert_close(a, b, rtol, atol), g, g_ref)


# ---------------------------------------------------------------------------------------------- forward + grad


def test_elementwise_forward_and_grad(key):
    f = warpnn.jax_kernel(K.scale_square)
    x = jax.random.normal(key, (N,))
    _vjp_check(lambda x: f(x, 1.5)[0], lambda x: K.scale_square_ref(x, 1.5), (x,), 0, key)


def test_gather_forward_and_grad(key):
    f = warpnn.jax_kernel(K.weighted_gather, launch_dims=None)
    x, w = jax.random.normal(key, (N,)), jax.random.normal(jax.random.PRNGKey(3), (N,))
    idx = jnp.asarray(np.random.default_rng(0).integers(0, N, N), jnp.int32)  # repeats: gradients accumulate
    _vjp_check(lambda x, w: f(x, idx, w, launch_dims=N)[0], lambda x, w: K.weighted_gather_ref(x, idx, w), (x, w), (0, 1), key)


def test_springs_scatter_forward_and_grad(springs_setup, key):
    pos, springs, stiffness, rest = springs_setup
    forces = springs_fn()
    _vjp_check(
        lambda p, k, r: forces(p, springs, k, r, 0.7),
        lambda p, k, r: K.spring_forces_ref(p, springs, k, r, 0.7),
        (pos, stiffness, rest), (0, 1, 2), key,
    )


def test_outputs_are_zeroed_every_call(springs_setup):
    pos, springs, stiffness, rest = springs_setup
    forces = jax.jit(springs_fn())
    first = forces(pos, springs, stiffness, rest)
    for _ in range(3):  # an accumulating kernel must not see the previous call's forces
        assert_close(forces(pos, springs, stiffness, rest), first, 0, 0)


def test_2d_launch_forward_and_grad(key):
    f = warpnn.jax_kernel(K.affine_2d)
    a = jax.random.normal(key, (5, 7))
    b, c = jnp.linspace(-1, 1, 7), jnp.linspace(0, 2, 5)
    _vjp_check(lambda a, b, c: f(a, b, c)[0], K.affine_2d_ref, (a, b, c), (0, 1, 2), key)


def test_multiple_outputs_with_own_shapes(key):
    f = warpnn.jax_kernel(K.two_outputs, num_outputs=2, output_dims={"y": N, "total": 1})
    x = jax.random.normal(key, (N,))
    _vjp_check(lambda x: f(x, 0.3), lambda x: K.two_outputs_ref(x, 0.3), (x,), 0, key)


def test_output_dims_accepts_jax_dims_for_vector_outputs(springs_setup):
    pos, springs, stiffness, rest = springs_setup
    f = warpnn.jax_kernel(K.spring_forces)
    (warp_dims,) = f(pos, springs, stiffness, rest, 1.0, launch_dims=springs.shape[0], output_dims=N)
    (jax_dims,) = f(pos, springs, stiffness, rest, 1.0, launch_dims=springs.shape[0], output_dims=(N, 3))
    assert warp_dims.shape == jax_dims.shape == (N, 3)
    assert_close(warp_dims, jax_dims, 0, 0)


def test_vector_and_matrix_dtypes(key):
    f = warpnn.jax_kernel(K.rotate)
    m = jax.random.normal(key, (N, 3, 3))
    v = jax.random.normal(jax.random.PRNGKey(5), (N, 3))
    _vjp_check(lambda m, v: f(m, v)[0], K.rotate_ref, (m, v), (0, 1), key)


def test_check_grads_float64(x64):
    f = warpnn.jax_kernel(K.cubic_f64)
    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float64)
    w = jnp.linspace(0.5, 2.0, 8, dtype=jnp.float64)
    check_grads(lambda x, w: f(x, w)[0], (x, w), order=1, modes=("rev",))
    assert_close(f(x, w)[0], K.cubic_f64_ref(x, w), 1e-12, 1e-12)


def test_integer_inputs_get_no_gradient(springs_setup):
    pos, springs, stiffness, rest = springs_setup
    forces = springs_fn()
    g = jax.grad(lambda p, s: forces(p, s, stiffness, rest).sum(), argnums=1, allow_int=True)(pos, springs)
    assert g.dtype == jax.dtypes.float0


# ---------------------------------------------------------------------------------------------- transformations


def test_jit_matches_eager(springs_setup):
    pos, springs, stiffness, rest = springs_setup
    forces = springs_fn()
    assert_close(jax.jit(forces, static_argnums=4)(pos, springs, stiffness, rest, 2.0),
                 forces(pos, springs, stiffness, rest, 2.0), 1e-6, 1e-6)


@pytest.mark.parametrize("batched", ["pos", "stiffness", "pos+stiffness", "springs"])
def test_vmap_springs_mixed_batched_and_shared_args(springs_setup, batched, key):
    pos, springs, stiffness, rest = springs_setup
    B = 3
    keys = jax.random.split(key, B)
    pos_b = pos[None] + 0.1 * jax.vmap(lambda k: jax.random.normal(k, pos.shape))(keys)
    k_b = stiffness[None] * jnp.arange(1.0, B + 1)[:, None]
    springs_b = jnp.stack([springs, springs[::-1], jnp.roll(springs, 1, 0)])
    args = {"pos": pos, "stiffness": stiffness, "springs": springs}
    axes = {"pos": None, "stiffness": None, "springs": None}
    for name, value in (("pos", pos_b), ("stiffness", k_b), ("springs", springs_b)):
        if name in batched:
            args[name], axes[name] = value, 0
    forces = springs_fn()

    def f(fn):
        return jax.vmap(lambda p, s, k: fn(p, s, k, rest, 1.0), in_axes=(axes["pos"], axes["springs"], axes["stiffness"]))

    out = f(forces)(args["pos"], args["springs"], args["stiffness"])
    ref = f(K.spring_forces_ref)(args["pos"], args["springs"], args["stiffness"])
    assert out.shape == (B, N, 3)
    assert_close(out, ref, 1e-4, 1e-5)


def test_vmap_of_grad_with_shared_connectivity(springs_setup, key):
    pos, springs, stiffness, rest = springs_setup
    pos_b = pos[None] + 0.1 * jax.random.normal(key, (4, *pos.shape))
    forces = springs_fn()

    def grads(fn):
        def energy_like(p, k):  # a scalar loss of the forces, differentiated w.r.t. positions and stiffness
            return jnp.sum(jnp.sin(fn(p, springs, k, rest, 1.0)))
        # positions batched, stiffness shared: its per-example gradients come back batched
        return jax.jit(jax.vmap(jax.grad(energy_like, argnums=(0, 1)), in_axes=(0, None)))(pos_b, stiffness)

    got, want = grads(forces), grads(K.spring_forces_ref)
    jax.tree.map(lambda a, b: assert_close(a, b, 1e-4, 1e-5), got, want)


def test_grad_of_vmap_sums_over_shared_arguments(springs_setup, key):
    pos, springs, stiffness, rest = springs_setup
    pos_b = pos[None] + 0.1 * jax.random.normal(key, (4, *pos.shape))
    forces = springs_fn()

    def loss(fn):
        return lambda k: jnp.sum(jax.vmap(lambda p: fn(p, springs, k, rest, 1.0))(pos_b) ** 2)

    assert_close(jax.grad(loss(forces))(stiffness), jax.grad(loss(K.spring_forces_ref))(stiffness), 1e-4, 1e-4)


def test_nested_vmap(key):
    f = warpnn.jax_kernel(K.weighted_gather)
    x = jax.random.normal(key, (2, 3, N))
    w = jax.random.normal(jax.random.PRNGKey(9), (3, N))  # batched over the inner axis only
    idx = jnp.asarray(np.random.default_rng(1).integers(0, N, N), jnp.int32)

    def run(fn):
        return jax.vmap(jax.vmap(fn, in_axes=(0, None, 0)), in_axes=(0, None, None))(x, idx, w)

    assert_close(run(lambda x, i, w: f(x, i, w)[0]), run(K.weighted_gather_ref), 1e-6, 1e-6)


def _rollout(forces_fn, steps=12, dt=0.05):
    def simulate(pos0, vel0, stiffness, rest, springs):
        def step(carry, _):
            p, v = carry
            v = 0.98 * v + dt * forces_fn(p, springs, stiffness, rest, 1.0)
            p = p + dt * v
            return (p, v), jnp.sum(p[:, 1])

        (p, v), heights = jax.lax.scan(step, (pos0, vel0), None, length=steps)
        return jnp.sum(p**2) + jnp.sum(heights)

    return simulate


def test_scan_rollout_gradient(springs_setup):
    pos, springs, stiffness, rest = springs_setup
    vel = jnp.zeros_like(pos)
    g = jax.jit(jax.grad(_rollout(springs_fn()), argnums=(0, 1, 2, 3)))(pos, vel, stiffness, rest, springs)
    g_ref = jax.grad(_rollout(K.spring_forces_ref), argnums=(0, 1, 2, 3))(pos, vel, stiffness, rest, springs)
    jax.tree.map(lambda a, b: assert_close(a, b, 2e-3, 2e-4), g, g_ref)


def test_scan_over_slices_gradient(key):
    """The kernel reads xs[t] and its result is stacked into ys: gradients match pure JAX. On a GPU, XLA also
    leaves the custom calls out of dynamic-slice fusions (see _bridge._fence), which would otherwise compute
    the slice offsets on the host every step."""
    f = warpnn.jax_kernel(K.scale_square)
    c0 = jax.random.normal(key, (N,))
    xs = jax.random.uniform(jax.random.PRNGKey(4), (5, N), minval=0.1, maxval=0.9)

    def loss(fn):
        def run(c, xs):
            c, ys = jax.lax.scan(lambda c, x: (lambda y: (c * y, y))(fn(x)), c, xs)
            return jnp.sum(c**2) + jnp.sum(jnp.cos(ys))

        return jax.grad(run, argnums=(0, 1))

    grad = jax.jit(loss(lambda x: f(x, 1.3)[0]))
    jax.tree.map(lambda a, b: assert_close(a, b, 1e-4, 1e-5), grad(c0, xs), loss(lambda x: K.scale_square_ref(x, 1.3))(c0, xs))
    if jax.default_backend() == "gpu":
        assert "__custom_fusion" not in grad.lower(c0, xs).compile().as_text()


def test_fori_loop_gradient(key):
    f = warpnn.jax_kernel(K.scale_square)
    x = jax.random.uniform(key, (N,), minval=0.1, maxval=0.9)

    def loop(fn):
        return lambda x: jax.lax.fori_loop(0, 3, lambda i, y: fn(y), x).sum()

    assert_close(jax.grad(loop(lambda y: f(y, 0.9)[0]))(x), jax.grad(loop(lambda y: K.scale_square_ref(y, 0.9)))(x), 1e-5, 1e-6)


def test_checkpoint_around_kernel(springs_setup):
    pos, springs, stiffness, rest = springs_setup
    forces = springs_fn()
    loss = lambda fn: lambda k: jnp.sum(jax.checkpoint(lambda k: fn(pos, springs, k, rest, 1.0))(k) ** 2)
    assert_close(jax.grad(loss(forces))(stiffness), jax.grad(loss(K.spring_forces_ref))(stiffness), 1e-4, 1e-4)


# ---------------------------------------------------------------------------------------------- inputs not differentiated


def _adjoint_result_counts(fn, *args) -> list[int]:
    """Results of each adjoint FFI call in the jaxpr of ``fn`` (nested jaxprs included)."""

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            spec = eqn.params.get("spec")
            if eqn.primitive.name == "warpnn_call" and "adj" in spec.target:
                yield len(eqn.outvars)
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        yield from walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        yield from walk(sub)

    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


@pytest.mark.parametrize("trained", [("pos",), ("stiffness",), ("stiffness", "rest"), ("pos", "rest")])
def test_only_differentiated_inputs_get_adjoints(springs_setup, key, trained):
    """Inputs JAX does not differentiate get no adjoint buffer (Warp skips their atomics); the others match."""
    pos, springs, stiffness, rest = springs_setup
    forces = springs_fn()
    values = {"pos": pos, "stiffness": stiffness, "rest": rest}
    weights = jax.random.normal(key, pos.shape)

    def loss(fn):
        def run(*trained_values):
            v = {**values, **dict(zip(trained, trained_values))}
            return jnp.vdot(weights, fn(v["pos"], springs, v["stiffness"], v["rest"], 0.7))

        return jax.grad(run, argnums=tuple(range(len(trained))))

    args = [values[n] for n in trained]
    got, want = jax.jit(loss(forces))(*args), loss(K.spring_forces_ref)(*args)
    jax.tree.map(lambda a, b: assert_close(a, b, 1e-4, 1e-5), got, want)
    assert _adjoint_result_counts(loss(forces), *args) == [len(trained)]


def test_stop_gradient_input_and_vmap_of_grad(springs_setup):
    pos, springs, stiffness, rest = springs_setup
    forces = springs_fn()

    def loss(fn):
        # pos is perturbed through stiffness-dependent motion; rest is held fixed by stop_gradient
        def run(k):
            p = pos + 0.1 * fn(pos, springs, k, jax.lax.stop_gradient(rest), 1.0)
            return jnp.sum(fn(p, springs, k, jax.lax.stop_gradient(rest), 1.0) ** 2)

        return jax.vmap(jax.grad(run))

    ks = jnp.stack([stiffness, 1.5 * stiffness])
    assert_close(jax.jit(loss(forces))(ks), loss(K.spring_forces_ref)(ks), 1e-4, 1e-5)
    assert sorted(_adjoint_result_counts(loss(forces), ks)) == [1, 2]  # (stiffness), then (pos, stiffness)


def test_unused_outputs(key):
    """An unused output has a symbolic-zero cotangent: with no used output there is no adjoint launch; with
    one used output of two, the unused one's adjoint is a zero array and the gradient matches."""
    f = warpnn.jax_kernel(K.two_outputs, num_outputs=2, output_dims={"y": N, "total": 1})
    x = jax.random.normal(key, (N,))
    none_used = jax.grad(lambda x: (f(x, 2.0), jnp.sum(x**2))[1])
    assert _adjoint_result_counts(none_used, x) == []
    assert_close(none_used(x), 2 * x, 1e-6, 1e-6)
    for index in (0, 1):
        got = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(f(x, 2.0)[index]))))(x)
        want = jax.grad(lambda x: jnp.sum(jnp.sin(K.two_outputs_ref(x, 2.0)[index])))(x)
        assert_close(got, want, 1e-5, 1e-6)


# ---------------------------------------------------------------------------------------------- registration / state


def test_one_registration_per_kernel_and_no_per_call_state():
    f = warpnn.jax_kernel(K.scale_square)
    x = jnp.ones(8)
    f(x, 1.0)
    registered = _launch.LAUNCHER.num_registered
    callbacks = len(_launch.LAUNCHER._callbacks)
    for i in range(50):  # changing static scalars retrace but never register or store anything per call
        warpnn.jax_kernel(K.scale_square)(x, float(i))
    jax.jit(lambda x: f(x, 3.0)[0])(x)
    assert _launch.LAUNCHER.num_registered == registered
    assert len(_launch.LAUNCHER._callbacks) == callbacks
    assert_close(warpnn.jax_kernel(K.scale_square)(x, 7.0)[0], 7.0 * x, 0, 0)


# ---------------------------------------------------------------------------------------------- errors


def test_error_wrong_dtype_names_argument_and_fix(springs_setup):
    pos, springs, stiffness, rest = springs_setup
    f = warpnn.jax_kernel(K.spring_forces)
    with pytest.raises(TypeError, match=r"'pos'.*float32.*got int32.*astype"):
        f(pos.astype(jnp.int32), springs, stiffness, rest, 1.0)


def test_error_wrong_rank(springs_setup):
    pos, springs, stiffness, rest = springs_setup
    f = warpnn.jax_kernel(K.spring_forces)
    with pytest.raises(ValueError, match=r"'pos'.*2-D float32.*got shape \(48,\)"):
        f(pos.reshape(-1), springs, stiffness, rest, 1.0)


def test_error_wrong_inner_dims(springs_setup):
    pos, springs, stiffness, rest = springs_setup
    f = warpnn.jax_kernel(K.spring_forces)
    with pytest.raises(ValueError, match=r"'pos'.*inner dims \(3,\).*got shape \(16, 2\)"):
        f(pos[:, :2], springs, stiffness, rest, 1.0)


def test_error_traced_scalar():
    f = warpnn.jax_kernel(K.scale_square)
    with pytest.raises(TypeError, match=r"'s' is a static float32 scalar, but got a traced value.*1-element array"):
        jax.jit(lambda x, s: f(x, s))(jnp.ones(4), 2.0)


def test_error_wrong_arity():
    f = warpnn.jax_kernel(K.scale_square)
    with pytest.raises(TypeError, match=r"takes 2 inputs \['x', 's'\].*outputs \['y'\].*called with 3"):
        f(jnp.ones(4), 1.0, jnp.ones(4))


def test_error_output_not_array():
    with pytest.raises(TypeError, match=r"output argument 's' is a static float32 scalar.*must be arrays"):
        warpnn.jax_kernel(K.scale_square, num_outputs=2)


def test_error_output_dims_keys():
    with pytest.raises(ValueError, match=r"output names \['y', 'total'\].*missing \['total'\]"):
        warpnn.jax_kernel(K.two_outputs, num_outputs=2, output_dims={"y": 4})


def test_error_not_a_kernel():
    with pytest.raises(TypeError, match="expects a Warp kernel"):
        warpnn.jax_kernel(lambda x: x)


_FORWARD_MODES = {
    "jvp": lambda g, x: jax.jvp(g, (x,), (x,)),
    "jit_jvp": lambda g, x: jax.jit(lambda x: jax.jvp(g, (x,), (x,)))(x),
    "jacfwd": lambda g, x: jax.jacfwd(g)(x),
    "jit_jacfwd": lambda g, x: jax.jit(jax.jacfwd(g))(x),
    "vmap_jvp": lambda g, x: jax.vmap(lambda x: jax.jvp(g, (x,), (x,)))(jnp.stack([x, x])),
    "hessian": lambda g, x: jax.hessian(lambda x: g(x).sum())(x),
    "jit_hessian": lambda g, x: jax.jit(jax.hessian(lambda x: g(x).sum()))(x),
}


@pytest.mark.parametrize("mode", sorted(_FORWARD_MODES))
def test_forward_mode_raises_warpnn_message_naming_the_kernel(mode):
    f = warpnn.jax_kernel(K.scale_square)
    with pytest.raises(TypeError, match=r"Kernel 'scale_square' is differentiable in reverse mode.*jax\.jacrev"):
        _FORWARD_MODES[mode](lambda x: f(x, 3.0)[0], jnp.arange(4.0))


def test_jacrev_is_the_fix_forward_mode_points_to():
    f = warpnn.jax_kernel(K.scale_square)
    x = jnp.arange(4.0)
    expected = jax.jacfwd(lambda x: K.scale_square_ref(x, 3.0))(x)
    np.testing.assert_allclose(jax.jacrev(lambda x: f(x, 3.0)[0])(x), expected, rtol=1e-6)


def test_grad_without_direct_linearize_is_not_mistaken_for_forward_mode():
    # A JAX that honours jax_use_direct_linearize=False traces jax.grad with JVP tracers: it must still work
    # (jax 0.10-0.12 ignore the flag and linearize directly).
    f = warpnn.jax_kernel(K.scale_square)
    x = jnp.arange(4.0)
    with _direct_linearize_off():
        grad = jax.grad(lambda x: f(x, 3.0)[0].sum())(x)
    np.testing.assert_allclose(grad, 6.0 * np.arange(4.0), rtol=1e-6)


@contextlib.contextmanager
def _direct_linearize_off():
    previous = jax.config.jax_use_direct_linearize
    jax.config.update("jax_use_direct_linearize", False)
    try:
        yield
    finally:
        jax.config.update("jax_use_direct_linearize", previous)


def test_second_order_is_refused_clearly():
    f = warpnn.jax_kernel(K.scale_square)
    g = jax.grad(lambda x: f(x, 1.0)[0].sum())
    with pytest.raises(NotImplementedError, match="reverse mode once"):
        jax.grad(lambda x: g(x).sum())(jnp.ones(4))


# ---------------------------------------------------------------------------------------------- residuals


def test_write_only_kernels_keep_no_outputs_for_backward(springs_setup):
    pos, springs, stiffness, rest = springs_setup
    forces = springs_fn()
    assert all(warpnn.jax_kernel(k, num_outputs=n).signature.outputs_read == ()
               for k, n in ((K.scale_square, 1), (K.spring_forces, 1), (K.two_outputs, 2), (K.affine_2d, 1)))
    # the residuals of a vjp are exactly the array inputs; the (N, 3) forces are not kept
    _, vjp = jax.vjp(lambda p, k, r: forces(p, springs, k, r), pos, stiffness, rest)
    kept = sorted(leaf.shape for leaf in jax.tree.leaves(vjp))
    assert kept == sorted([pos.shape, springs.shape, stiffness.shape, rest.shape])


@wp.kernel
def square_in_place(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    # reads its own output after writing it: Warp's adjoint, replaying against pre-launch values, cannot
    i = wp.tid()
    y[i] = x[i]
    y[i] = y[i] * x[i] + 1.0


def test_kernel_reading_its_output_runs_forward_and_refuses_reverse_mode(key):
    f = warpnn.jax_kernel(square_in_place)
    assert f.signature.outputs_read == ("y",)
    x = jax.random.normal(key, (N,))
    assert_close(f(x)[0], x * x + 1.0, 1e-6, 1e-6)
    with pytest.raises(TypeError, match=r"'square_in_place' cannot be differentiated.*array 'y': line \d+ reads it after the kernel wrote it"):
        jax.grad(lambda x: f(x)[0].sum())(x)


@wp.kernel
def store_if_positive(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    if x[i] > 0.0:
        y[i] = x[i]


@wp.kernel
def store_shifted(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i + 1] = x[i]


@wp.kernel
def store_after_early_return(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    if i > 3:
        return
    y[i] = x[i]


@wp.kernel
def newton_style_integrate(x: wp.array(dtype=float), active: wp.array(dtype=wp.int32), x_new: wp.array(dtype=float),
                           v_new: wp.array(dtype=float)):
    # Newton's integrate_particles: an inactive particle stores its position and returns (its velocity is left
    # as it was); an active one stores both at the end.
    tid = wp.tid()
    x0 = x[tid]
    if active[tid] == 0:
        x_new[tid] = x0
        return
    v1 = 2.0 * x0
    x_new[tid] = x0 + v1
    v_new[tid] = v1


@wp.kernel
def store_in_both_branches(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    if x[i] > 0.0:
        y[i] = x[i]
    elif x[i] < -1.0:
        y[i] = -x[i]
    else:
        y[i] = 0.5


@wp.kernel
def store_in_a_loop(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    for k in range(1):
        y[i] = x[i] + float(k)


@wp.kernel
def return_before_store_in_a_branch(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    if x[i] > 0.0:
        if x[i] > 1.0:
            return
        y[i] = x[i]
        return
    y[i] = -x[i]


@pytest.mark.parametrize(
    "kernel, num_outputs, written",
    [
        (newton_style_integrate, 2, ("x_new",)),  # v_new is not stored on the early-return path
        (store_in_both_branches, 1, ("y",)),
        (store_in_a_loop, 1, ()),
        (return_before_store_in_a_branch, 1, ()),
        (K.scale_square, 1, ("y",)),
        (K.affine_2d, 1, ("out",)),
        (K.two_outputs, 2, ("y",)),  # `total` accumulates: it must be zeroed
        (K.spring_forces, 1, ()),
        (store_if_positive, 1, ()),
        (store_shifted, 1, ()),
        (store_after_early_return, 1, ()),
    ],
)
def test_outputs_fully_written_analysis(kernel, num_outputs, written):
    assert warpnn.jax_kernel(kernel, num_outputs=num_outputs).signature.outputs_fully_written == written


def test_outputs_written_on_every_path_need_no_zeroing_and_the_others_still_get_it():
    f = warpnn.jax_kernel(newton_style_integrate, num_outputs=2)
    x = jnp.array([1.0, -2.0, 3.0, -4.0])
    active = jnp.array([1, 0, 1, 0], dtype=jnp.int32)
    for _ in range(3):  # later calls reuse buffers that held earlier values
        x_new, v_new = jax.jit(lambda x, a: f(x, a))(x, active)
        assert_close(x_new, jnp.where(active == 1, 3.0 * x, x), 0, 0)
        assert_close(v_new, jnp.where(active == 1, 2.0 * x, 0.0), 0, 0)
    g = warpnn.jax_kernel(store_in_both_branches)
    assert_close(g(x)[0], jnp.where(x > 0, x, jnp.where(x < -1.0, -x, 0.5)), 0, 0)


def test_conditionally_written_output_is_zero_where_not_written():
    f = warpnn.jax_kernel(store_if_positive)
    x = jnp.array([1.0, -2.0, 3.0, -4.0])
    for _ in range(2):  # the second call reuses buffers that held the first call's values
        assert_close(f(x)[0], jnp.maximum(x, 0.0), 0, 0)


def test_error_string_launch_dims():
    f = warpnn.jax_kernel(K.scale_square)
    with pytest.raises(TypeError, match=r"launch_dims must be an int or a tuple of ints, got the string 'x'"):
        f(jnp.ones(4), 1.0, launch_dims="x")


def test_dtype_error_spells_the_warp_type(springs_setup):
    pos, springs, stiffness, rest = springs_setup
    with pytest.raises(TypeError, match=r"wp\.array\(dtype=wp\.int32, ndim=2\)"):
        warpnn.jax_kernel(K.spring_forces)(pos, springs.astype(jnp.float32), stiffness, rest, 1.0)


@wp.kernel
def echo_id(x: wp.array(dtype=float), ident: wp.uint64, hi: wp.array(dtype=wp.uint32)):
    i = wp.tid()
    hi[i] = wp.uint32(ident >> wp.uint64(32))


def test_uint64_scalars_above_int64_range_round_trip():
    ident = (1 << 63) + (123 << 32)  # Warp object ids are pointers; any 64-bit pattern must survive
    (hi,) = warpnn.jax_kernel(echo_id)(jnp.ones(2), ident)
    assert np.asarray(hi).tolist() == [(ident >> 32) & 0xFFFFFFFF] * 2


def test_fully_written_output_is_still_zeroed_beyond_the_launch():
    f = warpnn.jax_kernel(K.scale_square)
    x = jnp.arange(1.0, 5.0)
    for _ in range(2):  # launch over 2 of 4 elements: the other two must read 0, not a stale buffer
        assert_close(f(x, 1.0, launch_dims=2, output_dims=4)[0], jnp.array([1.0, 4.0, 0.0, 0.0]), 0, 0)


@pytest.mark.parametrize("launcher", ["python", "native"])
def test_kernel_survives_warp_rebuilding_its_module(launcher):
    # Defining a kernel in a module Warp has loaded makes Warp rebuild that module; entry points taken
    # from the old build must stay valid (the launchers keep the old build loaded).
    with _launch.use_launcher(launcher):
        f = warpnn.jax_kernel(K.scale_square)
        x = jnp.arange(4.0)
        jax.jit(lambda x: f(x, 2.0)[0])(x)

        @wp.kernel(module=K.scale_square.module)  # joins (and so rebuilds) the module of the first kernel
        def late_kernel(x: wp.array(dtype=float), y: wp.array(dtype=float)):
            i = wp.tid()
            y[i] = x[i] + 1.0

        assert_close(warpnn.jax_kernel(late_kernel)(x)[0], x + 1.0, 0, 0)
        assert_close(jax.jit(lambda x: f(x, 3.0)[0])(x), 3.0 * x * x, 0, 0)


@wp.kernel(enable_backward=False)
def copy_without_adjoint(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = x[i]


@wp.kernel(enable_backward=False)
def spring_energy_without_adjoint(x: wp.array(dtype=float), k: wp.array(dtype=float), e: wp.array(dtype=float)):
    i = wp.tid()
    d = x[i + 1] - x[i]
    wp.atomic_add(e, 0, 0.5 * k[i] * d * d)


def test_kernel_compiled_without_adjoint_differentiates_through_a_rebuilt_one():
    """enable_backward=False (mujoco_warp builds most of its modules so): the forward launches the kernel as it is,
    the adjoint comes from its twin built with one (_twins.with_adjoint), never from editing the user's module."""
    f = warpnn.jax_kernel(copy_without_adjoint)
    x = jnp.arange(3.0)
    assert_close(f(x)[0], x, 0, 0)
    assert_close(jax.grad(lambda x: (f(x)[0] * x).sum())(x), 2.0 * x, 0, 0)
    g = warpnn.jax_kernel(spring_energy_without_adjoint)
    xs, ks = jnp.array([0.0, 0.5, 1.5, 1.7]), jnp.array([1.0, 2.0, 3.0])

    def energy(xs, ks):
        return g(xs, ks, launch_dims=3, output_dims=1)[0][0]

    def reference(xs, ks):
        return (0.5 * ks * jnp.diff(xs) ** 2).sum()

    assert_close(energy(xs, ks), reference(xs, ks))
    for got, want in zip(jax.jit(jax.grad(energy, argnums=(0, 1)))(xs, ks), jax.grad(reference, argnums=(0, 1))(xs, ks)):
        assert_close(got, want)
    assert not spring_energy_without_adjoint.module.options.get("enable_backward", True) or \
        spring_energy_without_adjoint.options.get("enable_backward") is False  # the user's kernel is as it was


@wp.func
def _bump(v: wp.ref[float]):
    v = v + 1.0


@wp.kernel(enable_backward=False)
def bumps_through_a_reference(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    v = x[i]
    _bump(v)  # Warp refuses wp.ref parameters in a kernel built with an adjoint
    y[i] = v * x[i]


def test_kernel_whose_adjoint_warp_cannot_generate_runs_forward_and_refuses_grad():
    f = warpnn.jax_kernel(bumps_through_a_reference)
    x = jnp.arange(3.0)
    assert_close(f(x)[0], (x + 1.0) * x, 0, 0)
    with pytest.raises(TypeError, match="'bumps_through_a_reference' cannot be differentiated: it was compiled without "
                                        "an adjoint .* Warp's code generator fails on it built with one"):
        jax.grad(lambda x: f(x)[0].sum())(x)
