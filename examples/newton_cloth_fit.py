"""Fit a Newton cloth's spring stiffness to an observed trajectory, through Newton's own solver inside JAX.

Newton's unmodified ``SolverSemiImplicit`` steps a 5x5 cloth thrown onto the ground (contact with friction); ``warpnn_models.newton``
turns the step into a pure JAX function (every Warp launch replayed as a differentiable ``warpnn.jax_kernel``
call). A 100-step ``lax.scan`` rollout with a guessed stiffness is fitted to one simulated with the true
stiffness, with optax, through the gradient of Warp's adjoint kernels. Needs ``pip install "warpnn[newton]"``.
"""

import jax
import jax.numpy as jnp
import newton
import optax
import warp as wp

from warpnn_models.newton import NewtonStep, rollout

wp.config.log_level = wp.LOG_WARNING  # quiet: no Warp banner or module-load lines (wp.LOG_INFO shows them)
STEPS, DT, TRUE_SCALE = 100, 1e-3, 1.8

builder = newton.ModelBuilder()
builder.add_cloth_grid(pos=wp.vec3(0.0, 0.0, 0.12), rot=wp.quat_identity(), vel=wp.vec3(0.3, 0.0, -0.5), dim_x=4,
                       dim_y=4, cell_x=0.1, cell_y=0.1, mass=0.1, add_springs=True, spring_ke=1e3, spring_kd=1.0,
                       tri_ke=1e2, tri_ka=1e2, tri_kd=0.1)
builder.add_ground_plane(cfg=newton.ModelBuilder.ShapeConfig(ke=1e3, kd=10.0, kf=10.0, mu=0.5))
model = builder.finalize(device="cpu")
model.particle_grid = None  # no particle self-contact: its hash grid is rebuilt on the host
model.spring_rest_length.assign(model.spring_rest_length.numpy() * 0.9)  # pre-stretched: the springs matter
model.soft_contact_ke, model.soft_contact_kd, model.soft_contact_kf, model.soft_contact_mu = 1e3, 10.0, 10.0, 0.5
pipeline = newton.CollisionPipeline(model, broad_phase="explicit", soft_contact_gap=10.0)
contacts = pipeline.contacts()
pipeline.collide(model.state(), contacts)
step = NewtonStep(model, newton.solvers.SolverSemiImplicit(model, enable_tri_contact=False), DT, contacts=contacts,
                  param_fields=("spring_stiffness",))
stiffness = step.initial_params()["spring_stiffness"]


def trajectory(log_scale):
    _, states = rollout(step, step.initial_state(), None, {"spring_stiffness": jnp.exp(log_scale) * stiffness},
                        num_steps=STEPS)
    return states["particle_q"]


observed = jax.jit(trajectory)(jnp.log(TRUE_SCALE))
loss = jax.jit(jax.value_and_grad(lambda s: jnp.mean((trajectory(s) - observed) ** 2)))
log_scale, optimizer = jnp.asarray(0.0), optax.adam(0.05)
opt_state = optimizer.init(log_scale)
first, _ = loss(log_scale)
for i in range(60):
    value, grad = loss(log_scale)
    updates, opt_state = optimizer.update(grad, opt_state)
    log_scale = optax.apply_updates(log_scale, updates)
value, _ = loss(log_scale)
print(f"loss {float(first):.3e} -> {float(value):.3e}; stiffness scale {float(jnp.exp(log_scale)):.3f} (true {TRUE_SCALE})")
assert value < first / 100 and abs(float(jnp.exp(log_scale)) - TRUE_SCALE) < 0.05 * TRUE_SCALE
