"""Data-parallel Warp calls on several devices, checked against one device. Run by tests/test_sharding.py.

XLA reads ``--xla_force_host_platform_device_count`` once per process, so this runs as its own process:

    python tests/sharding_check.py --devices 4                 # 4 CPU devices in this process
    python tests/sharding_check.py --devices 2 --num-processes 2 --process-id I --port P   # 2 processes

and prints one JSON object: ``{check name: {"error": max relative error vs one device, "collectives":
[...], "local_batch": ..., ...}}``. Every check computes the same function twice, on arrays committed to one
device and on arrays whose batch is sharded over a mesh of all devices, and compares; the test decides what
passes. On GPUs (``--platform gpu``) the same script checks every GPU against GPU 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=4, help="CPU devices per process (ignored with --platform gpu)")
    p.add_argument("--platform", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--port", type=int, default=0, help="coordinator port on localhost (multi-process)")
    p.add_argument("--checks", default="all", help="comma-separated subset of the checks")
    return p.parse_args()


ARGS = _parse()
if ARGS.platform == "cpu":
    # Before JAX starts: the flag is read once, when the CPU client is created.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={ARGS.devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

if ARGS.num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process CPU collectives
    jax.distributed.initialize(
        coordinator_address=f"localhost:{ARGS.port}", num_processes=ARGS.num_processes, process_id=ARGS.process_id
    )

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import warp as wp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

wp.config.quiet = True
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import warpnn  # noqa: E402
import warpnn._sharding  # noqa: E402
import warpnn.equinox  # noqa: E402
from tests.layer_kernels import SPRINGS, force_dataset  # noqa: E402
from warpnn.kernels.cloth import spring_forces, spring_forces_reference  # noqa: E402
from warpnn_models.cloth import Cloth, make_cloth_grid  # noqa: E402

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(compiled_text: str) -> list[str]:
    """The kinds of cross-device collective in a compiled (partitioned) HLO module."""
    return sorted({c for c in COLLECTIVES if re.search(rf"\b{c}(-start)?\(", compiled_text)})


def warp_call_batches(compiled_text: str) -> list[int]:
    """Leading (batch) dim of every result of every Warp custom call: the per-device batch when partitioned."""
    sizes = []
    for line in compiled_text.splitlines():
        if 'custom_call_target="warpnn' in line:
            result = line.split("custom-call(")[0].split("=", 1)[1]
            sizes += [int(m) for m in re.findall(r"\[(\d+)[,\]]", result)]
    return sorted(set(sizes))


def rel_error(actual, expected) -> float:
    """max |a - e| / max |e| over every leaf of two pytrees (0 when both are 0)."""
    worst = 0.0
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        scale = max(np.abs(e).max(initial=0.0), 1e-30)
        worst = max(worst, float(np.abs(a - e).max(initial=0.0) / scale))
    return worst


def fully_addressable(tree):
    """NumPy copies of the global values of (possibly multi-process) arrays."""
    from jax.experimental import multihost_utils

    def get(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(get, tree)


MESH_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


def make_mesh(kind: str):
    return jax.make_mesh((jax.device_count(),), ("data",), axis_types=(MESH_TYPES[kind],))


def shard_batch(mesh, tree):
    """Put arrays with a leading batch dim on ``mesh``, batch split over 'data' (each process: its own slice)."""
    sharding = NamedSharding(mesh, P("data"))

    def put(x):
        x = np.asarray(x)
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        per = x.shape[0] // jax.process_count()
        local = x[jax.process_index() * per : (jax.process_index() + 1) * per]
        return jax.make_array_from_process_local_data(sharding, local, x.shape)

    return jax.tree.map(put, tree)


def _put(tree, where):
    # Only array leaves move (a module may also hold functions, e.g. an MLP's activation).
    return jax.tree.map(lambda x: jax.device_put(x, where) if eqx.is_array(x) else x, tree)


def replicate(mesh, tree):
    return _put(tree, NamedSharding(mesh, P()))


def one_device(tree):
    return _put(tree, jax.local_devices()[0])


# --------------------------------------------------------------------------------------------------
# Checks. Each returns a dict of measurements.


def cloth_batch(batch: int, rows: int = 6, seed: int = 0):
    """``batch`` perturbed copies of one cloth (shared springs): positions and velocities (batch, n, 3)."""
    grid = make_cloth_grid(rows, rows, spacing=0.1, pinned="top-corners")
    rng = np.random.default_rng(seed)
    x = grid.positions[None] + 0.02 * rng.standard_normal((batch, *grid.positions.shape)).astype(np.float32)
    v = 0.3 * rng.standard_normal(x.shape).astype(np.float32)
    return grid, x, v


def cloth_springs(grid, stiffness, x_batched: bool = True, fn=spring_forces):
    """``forces(x, v)`` of ``grid``'s springs (damping 0.1 stiffness) vmapped over a batch of cloths; ``x`` is
    shared by the batch when ``x_batched`` is False."""
    springs, rest = jnp.asarray(grid.springs), jnp.asarray(grid.rest_length)
    batched = jax.vmap(fn, in_axes=(0 if x_batched else None, 0, None, None, None, None))
    return lambda x, v: batched(x, v, springs, stiffness, 0.1 * stiffness, rest)


def check_spring_layer(kind: str) -> dict:
    """``warpnn.kernels.cloth.spring_forces`` over a batch of cloths sharing connectivity: forward and gradients
    with respect to the batch (positions) and the shared per-spring stiffness."""
    mesh = make_mesh(kind)
    grid, x, v = cloth_batch(2 * jax.device_count())
    stiffness = jnp.linspace(50.0, 150.0, grid.springs.shape[0], dtype=jnp.float32)

    def forces(x, v, stiffness, fn=spring_forces):
        return cloth_springs(grid, stiffness, fn=fn)(x, v)

    def loss(stiffness, x, v, fn=spring_forces):
        return jnp.sum(forces(x, v, stiffness, fn) ** 2)

    grad = jax.grad(loss, argnums=(0, 1))
    f1, g1 = jax.jit(forces)(*one_device((x, v, stiffness))), jax.jit(grad)(*one_device((stiffness, x, v)))
    reference = jax.jit(jax.grad(lambda *a: loss(*a, fn=spring_forces_reference), argnums=(0, 1)))(stiffness, x, v)
    xs, vs = shard_batch(mesh, (x, v))
    ks = replicate(mesh, stiffness)
    fwd, bwd = jax.jit(forces), jax.jit(grad)
    fwd_hlo = fwd.lower(xs, vs, ks).compile().as_text()
    bwd_hlo = bwd.lower(ks, xs, vs).compile().as_text()
    f, g = fwd(xs, vs, ks), bwd(ks, xs, vs)
    return {
        "forward_error": rel_error(fully_addressable(f), f1),
        "grad_error": rel_error(fully_addressable(g[0]), g1[0]),
        "grad_reference_error": rel_error(g1, reference),
        "forward_collectives": collectives(fwd_hlo),
        "grad_collectives": collectives(bwd_hlo),
        "forward_local_batch": warp_call_batches(fwd_hlo),
        "grad_local_batch": warp_call_batches(bwd_hlo),
        "global_batch": x.shape[0],
        "output_spec": str(f.sharding.spec),
    }


def check_shard_map() -> dict:
    """The same springs under ``shard_map(check_vma=True)``: outputs vary over the mesh axis, gradients of the
    replicated stiffness are summed over devices by JAX (the loss is pmean-ed before grad), and returning a
    per-device value as replicated is refused."""
    mesh = make_mesh("explicit")
    grid, x, v = cloth_batch(2 * jax.device_count())
    stiffness = jnp.linspace(50.0, 150.0, grid.springs.shape[0], dtype=jnp.float32)
    seen = {}

    def forces(x, v, stiffness):
        f = cloth_springs(grid, stiffness)(x, v)
        seen["vma"] = sorted(warpnn._sharding.vma_of(f))
        return f

    def loss(stiffness, x, v):
        return jnp.mean(forces(x, v, stiffness) ** 2)

    def local_step(stiffness, x, v):
        return jax.value_and_grad(lambda k: jax.lax.pmean(loss(k, x, v), "data"))(stiffness)

    step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P())))
    xs, vs = shard_batch(mesh, (x, v))
    ks = replicate(mesh, stiffness)
    value, grad = step(ks, xs, vs)
    value1, grad1 = jax.jit(jax.value_and_grad(loss))(*one_device((stiffness, x, v)))
    refused = False
    try:  # a per-device sum returned as if replicated: only a correct vma type lets JAX refuse it
        jax.jit(jax.shard_map(lambda x, v, k: jnp.sum(forces(x, v, k) ** 2), mesh=mesh,
                              in_specs=(P("data"), P("data"), P()), out_specs=P()))(xs, vs, ks)
    except ValueError as e:
        refused = "replication" in str(e) or "vma" in str(e) or "varying" in str(e)
    return {
        "value_error": rel_error(fully_addressable(value), value1),
        "grad_error": rel_error(fully_addressable(grad), grad1),
        "output_vma": seen["vma"],
        "invariant_out_spec_refused": refused,
    }


def check_cloth_rollout() -> dict:
    """Gradient of a 10-step ``lax.scan`` rollout of a batch of cloths (Warp springs + integrator) from one shared
    initial position and per-cloth velocities, with respect to the shared material stiffness and damping.
    (Auto axes: in Explicit mode JAX 0.10 cannot vmap a scan whose initial carry is shared by the batch.)"""
    mesh = make_mesh("auto")
    grid, x, v = cloth_batch(2 * jax.device_count(), rows=5, seed=1)
    cloth = Cloth.from_grid(grid, stiffness=[400.0, 200.0, 20.0], damping=[2.0, 1.0, 0.2], dt=4e-3)
    x0 = jnp.asarray(x[0])

    def loss(theta, v0):
        c = dataclasses.replace(cloth, stiffness=theta["stiffness"], damping=theta["damping"])
        xs, vs = jax.vmap(lambda v: c.rollout(x0, v, num_steps=10))(v0)
        return jnp.mean(xs[:, -1] ** 2) + jnp.mean(vs[:, -1] ** 2)

    theta = {"stiffness": cloth.stiffness, "damping": cloth.damping}
    fn = jax.jit(jax.value_and_grad(loss))
    one = fn(*one_device((theta, v)))
    args = (replicate(mesh, theta), *shard_batch(mesh, (v,)))
    hlo = fn.lower(*args).compile().as_text()
    sharded = fn(*args)
    return {
        "error": rel_error(fully_addressable(sharded), one),
        "collectives": collectives(hlo),
        "local_batch": warp_call_batches(hlo),
        "global_batch": v.shape[0],
    }


def _force_data():
    xs, target, edges, rest = force_dataset(num=4 * jax.device_count())
    return np.asarray(xs), np.asarray(target), edges, rest


def check_equinox() -> dict:
    """Three Adam steps of an Equinox model (Warp spring layer + MLP) on a sharded batch vs one device."""
    mesh = make_mesh("explicit")
    xs, target, edges, rest = _force_data()

    class Model(eqx.Module):
        springs: warpnn.equinox.WarpLayer
        mlp: eqx.nn.MLP

        def __call__(self, x):
            return self.springs(x) + jax.vmap(self.mlp)(x)

    model = Model(
        warpnn.equinox.WarpLayer(SPRINGS, params={"k": jnp.ones(1)}, buffers={"edges": edges, "rest": rest},
                                 static={"scale": 1.0}),
        eqx.nn.MLP(3, 3, 16, 1, activation=jnp.tanh, key=jax.random.PRNGKey(0)),
    )
    optimizer = optax.adam(1e-2)
    spec = warpnn.equinox.trainable(model)

    @eqx.filter_jit
    def step(model, opt_state, xs, target):
        def loss_fn(m):
            return jnp.mean((jax.vmap(m)(xs) - target) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = optimizer.update(eqx.filter(grads, spec), opt_state, eqx.filter(model, spec))
        return eqx.apply_updates(model, updates), opt_state, loss

    def train(model, xs, target):
        opt_state = optimizer.init(eqx.filter(model, spec))
        losses = []
        for _ in range(3):
            model, opt_state, loss = step(model, opt_state, xs, target)
            losses.append(loss)
        return eqx.filter(model, eqx.is_inexact_array), losses

    params1, losses1 = train(*one_device((model, xs, target)))
    sharded_model = replicate(mesh, model)
    sharded_data = shard_batch(mesh, (xs, target))
    lowered = step.lower(sharded_model, optimizer.init(eqx.filter(sharded_model, spec)), *sharded_data)
    hlo = lowered.lowered.compile().as_text()  # eqx.filter_jit wraps the jax.stages.Lowered
    params, losses = train(sharded_model, *sharded_data)
    return {
        "param_error": rel_error(fully_addressable(params), params1),
        "loss_error": rel_error(fully_addressable(losses), losses1),
        "collectives": collectives(hlo),
        "local_batch": warp_call_batches(hlo),
        "global_batch": xs.shape[0],
    }


def check_nnx() -> dict:
    """Three steps of an NNX model (Warp spring layer + Linear layers) with nnx.Optimizer on a sharded batch."""
    from flax import nnx

    import warpnn.nnx

    mesh = make_mesh("explicit")
    xs, target, edges, rest = _force_data()

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.springs = warpnn.nnx.WarpLayer(SPRINGS, params={"k": jnp.ones(1)},
                                                buffers={"edges": edges, "rest": rest}, static={"scale": 1.0})
            self.hidden = nnx.Linear(3, 16, rngs=rngs)
            self.out = nnx.Linear(16, 3, rngs=rngs)

        def __call__(self, x):
            return self.springs(x) + self.out(jnp.tanh(self.hidden(x)))

    @nnx.jit
    def step(model, optimizer, xs, target):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((jax.vmap(m)(xs) - target) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    def train(place, xs, target):
        model = Model(nnx.Rngs(0))
        state = place(nnx.state(model))
        nnx.update(model, state)
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        losses = [step(model, optimizer, xs, target) for _ in range(3)]
        return nnx.state(model, nnx.Param), losses

    params1, losses1 = train(one_device, *one_device((xs, target)))
    params, losses = train(lambda s: replicate(mesh, s), *shard_batch(mesh, (xs, target)))
    return {
        "param_error": rel_error(fully_addressable(params), params1),
        "loss_error": rel_error(fully_addressable(losses), losses1),
    }


def check_linen() -> dict:
    """Three steps of a Linen model (Warp spring layer + Dense layers) with a TrainState on a sharded batch."""
    from flax import linen as nn
    from flax.training.train_state import TrainState

    import warpnn.linen

    mesh = make_mesh("explicit")
    xs, target, edges, rest = _force_data()

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            springs = warpnn.linen.WarpLayer(SPRINGS, params={"k": (nn.initializers.ones, (1,))},
                                             buffers={"edges": edges, "rest": rest}, static={"scale": 1.0})
            return springs(x) + nn.Dense(3)(jnp.tanh(nn.Dense(16)(x)))

    model = Model()
    variables = model.init(jax.random.PRNGKey(0), xs[0])
    buffers = variables[warpnn.linen.BUFFERS]

    @jax.jit
    def step(state, buffers, xs, target):
        def loss_fn(params):
            forces = jax.vmap(lambda x: state.apply_fn({"params": params, warpnn.linen.BUFFERS: buffers}, x))(xs)
            return jnp.mean((forces - target) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    def train(params, buffers, xs, target):
        state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
        losses = []
        for _ in range(3):
            state, loss = step(state, buffers, xs, target)
            losses.append(loss)
        return state.params, losses

    params1, losses1 = train(*one_device((variables["params"], buffers, xs, target)))
    sharded_params, sharded_buffers = replicate(mesh, (variables["params"], buffers))
    sharded_data = shard_batch(mesh, (xs, target))
    state = TrainState.create(apply_fn=model.apply, params=sharded_params, tx=optax.adam(1e-2))
    hlo = step.lower(state, sharded_buffers, *sharded_data).compile().as_text()
    params, losses = train(sharded_params, sharded_buffers, *sharded_data)
    return {
        "param_error": rel_error(fully_addressable(params), params1),
        "loss_error": rel_error(fully_addressable(losses), losses1),
        "collectives": collectives(hlo),
        "local_batch": warp_call_batches(hlo),
        "global_batch": xs.shape[0],
    }


def check_indivisible() -> dict:
    """A batch that the devices do not divide (sliced from a sharded one): computed, correctly, without
    padding the batch."""
    mesh = make_mesh("auto")
    n = jax.device_count()
    grid, x, v = cloth_batch(2 * n)
    springs = cloth_springs(grid, jnp.full((grid.springs.shape[0],), 100.0, jnp.float32))

    def forces(x, v):
        return springs(x[: 2 * n - 1], v[: 2 * n - 1])  # 2n - 1 cloths

    one = jax.jit(forces)(*one_device((x, v)))
    args = shard_batch(mesh, (x, v))
    hlo = jax.jit(forces).lower(*args).compile().as_text()
    sharded = jax.jit(forces)(*args)
    return {"error": rel_error(fully_addressable(sharded), one), "local_batch": warp_call_batches(hlo),
            "global_batch": 2 * n - 1}


def check_eager() -> dict:
    """An eager (un-jitted) vmapped call on sharded arrays."""
    mesh = make_mesh("explicit")
    grid, x, v = cloth_batch(2 * jax.device_count())
    forces = cloth_springs(grid, jnp.full((grid.springs.shape[0],), 100.0, jnp.float32))
    one = forces(*one_device((x, v)))
    sharded = forces(*shard_batch(mesh, (x, v)))
    return {"error": rel_error(fully_addressable(sharded), one), "output_spec": str(sharded.sharding.spec)}


def check_per_device() -> dict:
    """``jit(grad)`` of the springs on each local device alone, against device 0 (Warp's own multi-GPU
    autodiff tests are skipped upstream: on devices > 0 they saw zero gradients)."""
    grid, x, v = cloth_batch(4)
    stiffness = jnp.linspace(50.0, 150.0, grid.springs.shape[0], dtype=jnp.float32)

    def loss(stiffness, x, v):
        return jnp.sum(cloth_springs(grid, stiffness)(x, v) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    results = [grad(*jax.device_put((stiffness, x, v), d)) for d in jax.local_devices()]
    return {
        "errors": [rel_error(r, results[0]) for r in results],
        "norms": [float(np.linalg.norm(np.asarray(r[0]))) for r in results],
        "devices": [str(d) for d in jax.local_devices()],
    }


def check_shared_first_operand() -> dict:
    """Explicit sharding, first operand shared by the batch (an unsharded constant) and the second sharded:
    the result takes the batch sharding of the operand that has one."""
    mesh = make_mesh("explicit")
    grid, x, v = cloth_batch(2 * jax.device_count())
    springs = cloth_springs(grid, jnp.full((grid.springs.shape[0],), 100.0, jnp.float32), x_batched=False)

    def forces(v):
        return springs(jnp.asarray(x[0]), v)

    one = jax.jit(forces)(one_device(v))
    (vs,) = shard_batch(mesh, (v,))
    hlo = jax.jit(forces).lower(vs).compile().as_text()
    sharded = jax.jit(forces)(vs)
    return {"error": rel_error(fully_addressable(sharded), one), "output_spec": str(sharded.sharding.spec),
            "collectives": collectives(hlo), "local_batch": warp_call_batches(hlo), "global_batch": v.shape[0]}


def check_in_place_pair() -> dict:
    """An elementwise kernel (``y[i] = f(x[i])``, whose output warpnn may write into its input's buffer, and
    whose adjoint into the output's cotangent) vmapped over a sharded batch: forward, a forward-only scan and
    the gradient against pure JAX, the batch still split, and the caller's sharded input unchanged."""
    from tests.test_in_place_pairs import blend, blend_ref

    mesh = make_mesh("explicit")
    key_x, key_a = jax.random.split(jax.random.PRNGKey(5))
    batch = 2 * jax.device_count()
    x, alpha = shard_batch(mesh, (jax.random.normal(key_x, (batch, 64)), 0.5 + jax.random.uniform(key_a, (batch, 64))))
    before = fully_addressable(x).copy()
    f = warpnn.jax_kernel(blend)
    step = jax.vmap(lambda x, a: f(x, a)[0])
    forward = jax.jit(step)
    scan = jax.jit(lambda x, a: jax.lax.scan(lambda c, _: (0.5 * step(c, a), None), x, None, length=4)[0])
    grad = jax.jit(jax.grad(lambda x, a: jnp.sum(step(x, a) ** 2), argnums=(0, 1)))
    plain = [jnp.asarray(fully_addressable(v)) for v in (x, alpha)]  # pure JAX's references, unsharded
    ref_scan = plain[0]
    for _ in range(4):
        ref_scan = 0.5 * blend_ref(ref_scan, plain[1])
    ref_grad = jax.grad(lambda x, a: jnp.sum(blend_ref(x, a) ** 2), argnums=(0, 1))(*plain)
    y = forward(x, alpha)
    return {
        "forward_error": rel_error(fully_addressable(y), blend_ref(*plain)),
        "scan_error": rel_error(fully_addressable(scan(x, alpha)), ref_scan),
        "grad_error": rel_error(fully_addressable(grad(x, alpha)), ref_grad),
        "aliased": "output_to_operand_aliasing" in forward.lower(x, alpha).compile().as_text(),
        "input_unchanged": bool(np.array_equal(fully_addressable(x), before)),
        "output_spec": str(y.sharding.spec),
        "local_batch": warp_call_batches(forward.lower(x, alpha).compile().as_text()),
        "global_batch": batch,
    }


CHECKS = {
    "in_place_pair": check_in_place_pair,
    "per_device": check_per_device,
    "spring_layer_explicit": lambda: check_spring_layer("explicit"),
    "spring_layer_auto": lambda: check_spring_layer("auto"),
    "shared_first_operand": check_shared_first_operand,
    "shard_map": check_shard_map,
    "cloth_rollout": check_cloth_rollout,
    "equinox": check_equinox,
    "nnx": check_nnx,
    "linen": check_linen,
    "indivisible": check_indivisible,
    "eager": check_eager,
}


def main() -> None:
    names = list(CHECKS) if ARGS.checks == "all" else ARGS.checks.split(",")
    out = {
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "platform": jax.default_backend(),
        "launcher": warpnn._launch.LAUNCHER.name,
        "bridge_partitions": hasattr(warpnn._bridge, "_sharding"),
    }
    for name in names:
        out[name] = CHECKS[name]()
    print("RESULT " + json.dumps(out))
    if ARGS.num_processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
