"""The framework-neutral binding core (warpnn.bind / Binding), the three adapters side by side, atomic writes."""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp
from flax import nnx
from .helpers import assert_close
from .layer_kernels import (
    SPRINGS,
    closest_point_distance,
    closest_point_distance_reference,
    rollout,
    spring_forces,
    spring_forces_reference,
    spring_system,
    unit_square_mesh,
)

import warpnn
import warpnn.equinox
import warpnn.linen
import warpnn.nnx

K = jnp.array([2.0])
SCALE = 0.5


@pytest.fixture(scope="module")
def system():
    return spring_system()


def call_springs(binding, x, k, edges, rest, scale=SCALE):
    return binding((x,), {"k": k}, {"edges": edges, "rest": rest}, {"scale": scale})


def test_call_matches_reference_forward_and_grad(system):
    x, edges, rest = system
    assert_close(call_springs(SPRINGS, x, K, edges, rest), spring_forces_reference(x, edges, rest, K, SCALE))

    def loss(fn, x, k, rest):
        return jnp.sum(jnp.sin(fn(x, k, rest)))

    warp_fn = lambda x, k, rest: call_springs(SPRINGS, x, k, edges, rest)  # noqa: E731
    ref_fn = lambda x, k, rest: spring_forces_reference(x, edges, jax.lax.stop_gradient(rest), k, SCALE)  # noqa: E731
    got = jax.jit(jax.grad(lambda *a: loss(warp_fn, *a), argnums=(0, 1, 2)))(x, K, rest)
    want = jax.jit(jax.grad(lambda *a: loss(ref_fn, *a), argnums=(0, 1, 2)))(x, K, rest)
    for g, w in zip(got, want):
        assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert not np.any(got[2]), "buffers are state: no gradient may reach them"


@pytest.mark.parametrize(
    "launch_dims, output_dims",
    [
        (24, 12),
        ((24,), {"f": (12, 3)}),
        ("edges", "x"),
        (lambda a: a["edges"].shape[0], {"f": lambda a: a["x"].shape[:1]}),
    ],
    ids=["ints", "tuple-and-dict", "names", "functions"],
)
def test_dims_rules(system, launch_dims, output_dims):
    x, edges, rest = system
    binding = warpnn.bind(spring_forces, inputs=["x"], launch_dims=launch_dims, output_dims=output_dims)
    assert_close(call_springs(binding, x, K, edges, rest), spring_forces_reference(x, edges, rest, K, SCALE))


def test_dims_errors():
    with pytest.raises(ValueError, match=r"dims name must be an array input .* one of \['x', 'edges', 'rest', 'k'\]"):
        warpnn.bind(spring_forces, inputs=["x"], launch_dims="scale")
    with pytest.raises(ValueError, match=r"keys must be exactly the outputs \['f'\]"):
        warpnn.bind(spring_forces, inputs=["x"], output_dims={"g": 3})
    bad = warpnn.bind(spring_forces, inputs=["x"], launch_dims=lambda a: "edges")
    x, edges, rest = spring_system()
    with pytest.raises(TypeError, match=r"the launch_dims function .* must return 1 to 4 non-negative ints .* got .edges."):
        call_springs(bad, x, K, edges, rest)


def test_binding_errors_name_the_argument_and_list_the_kernel():
    x, edges, rest = spring_system()
    fields = {"params": {"k": K}, "buffers": {"edges": edges, "rest": rest}, "static": {"scale": 1.0}}

    def check(**changes):
        SPRINGS.check_fields(**{**fields, **changes})

    check()  # the complete binding is fine
    listing = r"(.|\n)*Kernel 'spring_forces' arguments:\n  x: 2-D float32 array .* \(call input\)\n  edges: "
    with pytest.raises(ValueError, match=r"arguments \['rest'\] are not bound" + listing):
        check(buffers={"edges": edges})
    with pytest.raises(ValueError, match=r"'k' is bound twice: as params= and in buffers="):
        check(buffers={"edges": edges, "rest": rest, "k": K})
    with pytest.raises(ValueError, match=r"'x' is bound twice: as a call input and in params="):
        check(params={"k": K, "x": x})
    with pytest.raises(ValueError, match=r"'stiffness' is not an input of kernel 'spring_forces'"):
        check(params={"stiffness": K})
    with pytest.raises(ValueError, match=r"'f' is an output \(outputs are returned"):
        check(params={"k": K, "f": x})
    with pytest.raises(TypeError, match=r"'scale' is a static float32 scalar: pass it in static="):
        check(params={"k": K, "scale": jnp.ones(1)}, static={})
    with pytest.raises(TypeError, match=r"'edges' is a 2-D int32 array .*only float arrays can be trained"):
        check(params={"k": K, "edges": edges}, buffers={"rest": rest})
    with pytest.raises(TypeError, match=r"'rest' is a 1-D float32 array .*, but static= holds the kernel's scalar"):
        check(buffers={"edges": edges}, static={"scale": 1.0, "rest": 0.5})
    with pytest.raises(TypeError, match=r"argument 'edges' expects dtype int32 .*got int64.*edges.astype\(jnp.int32\)"):
        check(buffers={"edges": np.asarray(edges, np.int64), "rest": rest})
    with pytest.raises(ValueError, match=r"'scale' is a scalar argument \(scalars are static"):
        warpnn.bind(spring_forces, inputs=["x", "scale"])
    with pytest.raises(TypeError, match=r"takes 1 call inputs \['x'\], got 2"):
        SPRINGS((x, x), fields["params"], fields["buffers"], fields["static"])


def test_static_misuse_is_refused_before_launch(system):
    x, edges, rest = system
    with pytest.raises(TypeError, match=r"static value 'scale' .* is an array of shape \(\)(.|\n)*scale\[0\]"):
        call_springs(SPRINGS, x, K, edges, rest, scale=jnp.float32(1.0))
    with pytest.raises(TypeError, match=r"static value 'scale' .* is a traced value"):
        jax.jit(lambda s: call_springs(SPRINGS, x, K, edges, rest, scale=s))(1.0)


def test_vmap_remat_scan(system):
    x, edges, rest = system
    xs = x + 0.1 * jax.random.normal(jax.random.PRNGKey(1), (3, *x.shape))
    warp_force = lambda x, k: call_springs(SPRINGS, x, k, edges, rest)  # noqa: E731
    ref_force = lambda x, k: spring_forces_reference(x, edges, rest, k, SCALE)  # noqa: E731

    # vmap over configurations, the params shared (unbatched).
    assert_close(jax.jit(jax.vmap(warp_force, (0, None)))(xs, K), jax.jit(jax.vmap(ref_force, (0, None)))(xs, K))

    # remat around the layer, inside a scan rollout, differentiated w.r.t. the start state and the param.
    def loss(force, x0, k):
        return jnp.sum(rollout(jax.checkpoint(lambda x: force(x, k)), x0) ** 2)

    def grads(force):
        grad = jax.grad(lambda x0, k: loss(force, x0, k), argnums=(0, 1))
        # the plain gradient, and per-example gradients (vmap of grad) w.r.t. the shared stiffness
        return jax.jit(lambda: (grad(x, K), jax.vmap(grad, (0, None))(xs, K)[1]))()

    (got_dx, got_dk), got_per_example = grads(warp_force)
    (want_dx, want_dk), want_per_example = grads(ref_force)
    assert_close(got_dx, want_dx, rtol=1e-4, atol=1e-5)
    assert_close(got_dk, want_dk, rtol=1e-4)
    assert_close(got_per_example, want_per_example, rtol=1e-4)


def test_mesh_layer_owns_the_mesh_and_sees_refits():
    """A wp.Mesh id travels as a static uint64; the layer keeps the mesh alive; refit needs no retrace."""
    points = jnp.asarray(np.random.default_rng(0).uniform(-0.5, 1.5, (32, 3)), jnp.float32)
    binding = warpnn.bind(closest_point_distance, inputs=["points"])
    layer = warpnn.equinox.WarpLayer(binding, static={"mesh": unit_square_mesh(), "max_dist": 10.0})
    traces = []

    @eqx.filter_jit
    def loss(layer, p):
        traces.append(1)
        return jnp.sum(layer(p))

    assert_close(layer(points), closest_point_distance_reference(points), atol=1e-5)
    assert_close(jax.grad(loss, argnums=1)(layer, points), 2 * (points - _on_square(points)), atol=1e-5)
    assert_close(loss(layer, points), jnp.sum(closest_point_distance_reference(points)), rtol=1e-5)

    # Refit in place (same id): lift the square to z = 0.5. Wait for pending calls before mutating the mesh.
    mesh = layer.static["mesh"]
    jax.block_until_ready(loss(layer, points))
    mesh.points.assign(mesh.points.numpy() + np.array([0, 0, 0.5], np.float32))
    mesh.refit()
    shifted = points - jnp.array([0.0, 0.0, 0.5])
    assert_close(loss(layer, points), jnp.sum(closest_point_distance_reference(shifted)), rtol=1e-5)
    assert len(traces) == 1, "a refit keeps the id, so the compiled call is reused"


def _on_square(p):
    return jnp.concatenate([jnp.clip(p[:, :2], 0.0, 1.0), jnp.zeros_like(p[:, 2:])], -1)


def test_frameworks_agree_with_each_other_and_the_reference(system):
    """Same kernel, same values: Equinox, NNX and Linen give the reference's outputs and gradients."""
    x, edges, rest = system
    fields = dict(params={"k": K}, buffers={"edges": edges, "rest": rest}, static={"scale": SCALE})
    eqx_layer = warpnn.equinox.WarpLayer(SPRINGS, **fields)
    nnx_layer = warpnn.nnx.WarpLayer(SPRINGS, **fields)
    linen_layer = warpnn.linen.WarpLayer(SPRINGS, **fields)
    variables = linen_layer.init(jax.random.PRNGKey(0), x)

    def objective(f):
        return jnp.sum(jnp.sin(f))

    want_f = spring_forces_reference(x, edges, rest, K, SCALE)
    want_dk, want_dx = jax.grad(lambda k, x: objective(spring_forces_reference(x, edges, rest, k, SCALE)), (0, 1))(K, x)

    eqx_dk, eqx_dx = eqx.filter_grad(lambda mx: objective(mx[0](mx[1])))((eqx_layer, x))
    nnx_dk, nnx_dx = nnx.grad(lambda m, x: objective(m(x)), argnums=(0, 1))(nnx_layer, x)
    linen_apply = lambda p, b, x: linen_layer.apply({"params": p, "buffers": b}, x)  # noqa: E731
    linen_dk, linen_db, linen_dx = jax.grad(
        lambda p, rest, x: objective(linen_apply(p, {**variables["buffers"], "rest": rest}, x)), (0, 1, 2)
    )(variables["params"], rest, x)

    for f in (eqx_layer(x), nnx_layer(x), linen_layer.apply(variables, x)):
        assert_close(f, want_f)
    for dk in (eqx_dk.params["k"], nnx_dk["k"][...], linen_dk["k"]):
        assert_close(dk, want_dk, rtol=1e-4)
    for dx in (eqx_dx, nnx_dx, linen_dx):
        assert_close(dx, want_dx, rtol=1e-4, atol=1e-5)
    assert "rest" not in nnx_dk, "NNX differentiates nnx.Param only; buffers are not Params"
    assert not np.any(eqx_dk.buffers["rest"]) and not np.any(linen_db), "buffers get no gradient"


def test_atomic_write_replaces_whole_files_only(tmp_path):
    path = tmp_path / "sub" / "ckpt.bin"
    warpnn.atomic_write_bytes(path, b"old")
    with pytest.raises(RuntimeError, match="crash"):
        with warpnn.atomic_write(path) as f:
            f.write(b"half of the new")
            raise RuntimeError("crash")
    assert path.read_bytes() == b"old"
    with warpnn.atomic_write(path) as f:
        f.write(b"new")
    assert path.read_bytes() == b"new"
    assert os.listdir(path.parent) == ["ckpt.bin"], "no temporary file is left behind"


def test_layers_of_a_mixed_kernel_are_hashable_static_metadata(system):
    x, edges, rest = system
    a = warpnn.equinox.WarpLayer(SPRINGS, {"k": K}, {"edges": edges, "rest": rest}, {"scale": 1.0})
    b = warpnn.equinox.WarpLayer(SPRINGS, {"k": 2 * K}, {"edges": edges, "rest": rest}, {"scale": 1.0})
    assert jax.tree.structure(a) == jax.tree.structure(b), "equal static values share compiled functions"
    assert hash(a.static) == hash(b.static)
    assert "spring_forces" in repr(SPRINGS)
