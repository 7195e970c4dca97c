"""warpnn.StageRule: the launches of one Python function differentiated as a whole by a JAX rule.

The stage here is a Gauss-Seidel solve of ``A x = b``: one kernel sweeping ``x`` in place, which reads what it wrote
(refused per kernel: Warp's adjoint would replay against the old ``x``). Its rule is the solve; gradients are
checked against pure JAX (``jnp.linalg.solve``), the forward against Warp running the same function."""

import dataclasses
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp

import warpnn
from warpnn._stage_rules import launch_matcher

from .helpers import assert_close

N = 4


@wp.kernel
def gauss_seidel(A: wp.array2d(dtype=float), b: wp.array(dtype=float), sweeps: int, x: wp.array(dtype=float),
                 residual: wp.array(dtype=float)):
    for _ in range(sweeps):
        for i in range(b.shape[0]):
            acc = b[i]
            for j in range(b.shape[0]):
                if j != i:
                    acc -= A[i, j] * x[j]
            x[i] = acc / A[i, i]
    for i in range(b.shape[0]):
        r = b[i]
        for j in range(b.shape[0]):
            r -= A[i, j] * x[j]
        residual[i] = r


@wp.kernel
def scale(a: wp.array2d(dtype=float), s: float, out: wp.array2d(dtype=float)):
    i, j = wp.tid()
    out[i, j] = s * a[i, j]


def solve(A, b, x, residual):
    """The stage: an iterative solve, as a library would write it."""
    x.zero_()
    wp.launch(gauss_seidel, 1, inputs=[A, b, 60], outputs=[x, residual])


THIS = sys.modules[__name__]


def solve_rule(before, after):
    return {"x": jnp.linalg.solve(before["A"], before["b"])}


def rule(rule=solve_rule, reads=lambda A, b, x, r: {"A": A, "b": b}, **more):
    return warpnn.StageRule(THIS, "solve", rule, reads=reads, writes=lambda A, b, x, r: {"x": x}, **more)


def problem():
    rng = np.random.default_rng(0)
    A = rng.normal(size=(N, N)).astype(np.float32)
    A = A @ A.T + N * np.eye(N, dtype=np.float32)  # symmetric positive definite: Gauss-Seidel converges
    b = rng.normal(size=N).astype(np.float32)
    return A, b


def traced(rules, with_residual=False):
    """A program: A2 = 2 A (a kernel before the stage, so A2 is computed, not an input), then the stage."""
    A, b = problem()
    A_in, b_in = wp.array(A), wp.array(b)
    A2, x, r = wp.zeros((N, N), dtype=float), wp.zeros(N, dtype=float), wp.zeros(N, dtype=float)

    def step():
        wp.launch(scale, (N, N), inputs=[A_in, 2.0], outputs=[A2])
        THIS.solve(A2, b_in, x, r)

    outputs = {"x": x, "residual": r} if with_residual else {"x": x}
    return warpnn.trace(step, {"A": A_in, "b": b_in}, outputs, rules=rules), A, b


@pytest.fixture(autouse=True)
def on_cpu():
    with wp.ScopedDevice("cpu"), jax.default_device(jax.devices("cpu")[0]):
        yield


def test_gradients_through_the_stage_are_the_rules_and_the_forward_is_warps():
    program, A, b = traced([rule()])
    assert program.reverse_refusals() == {}
    assert "stage tests.test_stage_rules.solve" in program.describe()
    w = jnp.arange(1.0, N + 1)

    def loss(A, b):
        return jnp.sum(w * program({"A": A, "b": b})["x"])

    def reference(A, b):
        return jnp.sum(w * jnp.linalg.solve(2 * A, b))

    # forward: Warp's Gauss-Seidel as launched (not the rule's solve), checked against Warp run directly
    x_warp = wp.zeros(N, dtype=float)
    solve(wp.array(2 * A), wp.array(b), x_warp, wp.zeros(N, dtype=float))
    assert_close(program({"A": A, "b": b})["x"], x_warp.numpy(), rtol=0, atol=0)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(A, b)
    expected = jax.grad(reference, argnums=(0, 1))(A, b)
    assert_close(grads[0], expected[0], rtol=1e-4, atol=1e-5)
    assert_close(grads[1], expected[1], rtol=1e-4, atol=1e-5)
    # vmap over right-hand sides: the same as one at a time
    bs = np.stack([b, 2 * b, -b])
    batched = jax.vmap(jax.grad(loss, argnums=1), in_axes=(None, 0))(A, bs)
    assert_close(batched, np.stack([jax.grad(reference, argnums=1)(A, v) for v in bs]), rtol=1e-4, atol=1e-5)


def test_a_profile_names_the_stage_and_each_launch_forward_and_reverse():
    # XLA's profiles name operations by these scopes: which launch or which stage's rule a cost belongs to (the
    # stage's forward is its launches, whose FFI calls a profile names by kernel)
    program, A, b = traced([rule()])

    def loss(A, b):
        return jnp.sum(program({"A": A, "b": b})["x"])

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(A, b).as_text(debug_info=True)
    names = set(re.findall(r'loc\("([^"]*)"', text))
    assert any("/jvp(scale)/" in n for n in names)
    assert any("/transpose(jvp(scale))/" in n for n in names)
    assert any("/transpose(jvp(stage tests.test_stage_rules.solve))/" in n for n in names)


def _dot_precisions(jaxpr):
    """Every dot_general's precision in a jaxpr, sub-jaxprs (custom_vjp, pjit, linear solves) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params["precision"])
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    found += _dot_precisions(inner)
    return found


def test_the_rule_runs_at_full_float32_precision_not_xlas_gpu_default():
    # On an H100/H200, XLA's default float32 product is TF32 (a 10-bit mantissa): a rule's einsum there put
    # ~1e-3 relative error into MuJoCo gradients that the CPU computed to 1e-6. The rule stands for launches that
    # compute in full float32, so its products are HIGHEST, whatever the rule wrote.
    def einsum_rule(before, after):
        return {"x": jnp.einsum("ij,j->i", jnp.linalg.inv(before["A"]), before["b"])}

    program, A, b = traced([rule(einsum_rule)])
    grad = jax.grad(lambda A, b: jnp.sum(program({"A": A, "b": b})["x"]), argnums=(0, 1))
    precisions = _dot_precisions(jax.make_jaxpr(grad)(A, b).jaxpr)
    assert precisions, "the backward has the rule's products"
    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    assert all(p == highest for p in precisions), precisions
    expected = jax.grad(lambda A, b: jnp.sum(jnp.linalg.solve(2 * A, b)), argnums=(0, 1))(A, b)
    assert_close(jax.jit(grad)(A, b)[1], expected[1], rtol=1e-4, atol=1e-5)


def test_without_the_rule_the_kernel_is_refused():
    program, A, b = traced([])
    assert "gauss_seidel" in program.reverse_refusals()
    with pytest.raises(TypeError, match="gauss_seidel"):
        jax.grad(lambda A: jnp.sum(program({"A": A, "b": b})["x"]))(A)


def test_a_rule_that_does_not_reproduce_the_launches_is_refused():
    wrong = rule(rule=lambda before, after: {"x": before["b"]})
    program, A, b = traced([wrong])
    why = program.reverse_refusals()["tests.test_stage_rules.solve"]
    assert "does not reproduce the launches" in why and "'x'" in why
    assert_close(program({"A": A, "b": b})["x"], np.linalg.solve(2 * A, b), rtol=1e-4, atol=1e-5)  # forward as is
    with pytest.raises(TypeError, match="stage 'tests.test_stage_rules.solve'.*does not reproduce"):
        jax.grad(lambda A: jnp.sum(program({"A": A, "b": b})["x"]))(A)


def test_the_check_takes_equal_infinities_as_equal_and_refuses_any_other_mismatch():
    """A kernel may write an infinity (mujoco_warp's "no contact" distance): a rule writing the same infinity
    reproduces it; an infinity against a finite value, the other infinity or a NaN does not."""
    from warpnn._stage_rules import check

    before = {"A": np.eye(2, dtype=np.float32), "b": np.ones(2, np.float32)}
    want = np.array([1.5, np.inf], np.float32)
    for written, agrees in (([1.5, np.inf], True), ([1.5, 3.0], False), ([1.5, -np.inf], False),
                            ([1.5, np.nan], False), ([1.6, np.inf], False)):
        why = check(rule(rule=lambda before, after, w=written: {"x": jnp.asarray(w, jnp.float32)}), before,
                    {"x": want}, ["x"])
        assert (why is None) == agrees, (written, why)


def test_a_rule_that_reads_a_value_in_python_is_checked_all_the_same():
    """The check at trace time runs a rule jitted; one that needs concrete values (a Python branch on them) runs
    eagerly instead, and is checked alike: right, it is taken; wrong, refused."""
    def branching(before, after, wrong=False):
        x = jnp.linalg.solve(before["A"], before["b"])
        return {"x": -x if (float(jnp.abs(x).max()) > 0) == wrong else x}

    assert traced([rule(rule=branching)])[0].reverse_refusals() == {}
    why = traced([rule(rule=lambda before, after: branching(before, after, wrong=True))])[0].reverse_refusals()
    assert "does not reproduce the launches" in why["tests.test_stage_rules.solve"]


def test_a_read_the_rule_neither_takes_nor_ignores_is_refused():
    # b is an input of the program: without it in the rule, d/db would be lost
    partial = rule(reads=lambda A, b, x, r: {"A": A}, rule=lambda before, after: {"x": after["x"] + 0 * before["A"][0]})
    program, A, b = traced([partial])
    why = program.reverse_refusals()["tests.test_stage_rules.solve"]
    assert "neither reads nor ignores" in why and "'b'" in why
    ignored = rule(reads=lambda A, b, x, r: {"A": A}, ignores=lambda A, b, x, r: {"b": b},
                   rule=lambda before, after: {"x": after["x"] + 0 * before["A"][0]})
    assert traced([ignored])[0].reverse_refusals() == {}  # declared: the author's claim, taken


def test_a_gradient_through_a_write_the_rule_does_not_compute_is_nan_never_zero():
    program, A, b = traced([rule()], with_residual=True)

    def loss(A, use_residual):
        out = program({"A": A, "b": b})
        return jnp.sum(out["x"]) + (jnp.sum(out["residual"]) if use_residual else 0.0)

    assert np.isfinite(np.asarray(jax.grad(loss)(A, False))).all()
    assert np.isnan(np.asarray(jax.grad(loss)(A, True))).all()


def test_a_rule_naming_no_function_is_an_error():
    with pytest.raises(TypeError, match="not a function"):
        traced([warpnn.StageRule(THIS, "no_such_function", solve_rule, reads=dict, writes=dict)])


class Solvers:
    """Stage functions on a class: a static method, a class method and a method keep working after the trace."""

    @staticmethod
    def static(A, b, x, r):
        solve(A, b, x, r)

    @classmethod
    def of_class(cls, A, b, x, r):
        solve(A, b, x, r)

    def method(self, A, b, x, r):
        solve(A, b, x, r)


@pytest.mark.parametrize("name", ["static", "of_class", "method"])
def test_a_rule_on_a_class_method_differentiates_and_leaves_the_class_as_it_was(name):
    A, b = problem()
    A_in, b_in, x, r = wp.array(A), wp.array(b), wp.zeros(N, dtype=float), wp.zeros(N, dtype=float)
    solvers = Solvers()
    stage = warpnn.StageRule(Solvers, name, solve_rule, reads=lambda *a: {"A": a[-4], "b": a[-3]},
                             writes=lambda *a: {"x": a[-2]})
    before = dict(vars(Solvers))
    program = warpnn.trace(lambda: getattr(solvers, name)(A_in, b_in, x, r), {"A": A_in, "b": b_in}, {"x": x},
                           rules=[stage])
    assert dict(vars(Solvers)) == before
    assert program.reverse_refusals() == {}
    grad = jax.grad(lambda b: jnp.sum(program({"A": A, "b": b})["x"]))(b)
    assert_close(grad, jax.grad(lambda b: jnp.sum(jnp.linalg.solve(A, b)))(b), rtol=1e-4, atol=1e-5)


def test_a_per_launch_rule_differentiates_each_launch_of_its_kernel():
    """``per_launch=True``: the stage is a launch, wherever it is made (here inside ``solve``, after ``x.zero_()``);
    the rule's parts take the launch's arguments by the kernel's parameter names, the rule its scalars."""
    sweeps = []

    def seeing_scalars(before, after):
        sweeps.append(int(after["sweeps"]))
        return solve_rule(before, after)

    stage = warpnn.StageRule(THIS, "gauss_seidel", seeing_scalars, per_launch=True,
                             reads=lambda A, b, **_: {"A": A, "b": b}, writes=lambda x, **_: {"x": x},
                             ignores=lambda x, **_: {"x": x})  # (zeroed before the launch)
    program, A, b = traced([stage], with_residual=True)
    assert program.reverse_refusals() == {}
    assert "stage tests.test_stage_rules.gauss_seidel" in program.describe()
    grad = jax.grad(lambda A: jnp.sum(program({"A": A, "b": b})["x"]))(A)
    assert_close(grad, jax.grad(lambda A: jnp.sum(jnp.linalg.solve(2 * A, b)))(A), rtol=1e-4, atol=1e-5)
    assert sweeps and set(sweeps) == {60}  # (when traced, and in the backward)
    # the residual is written by the launch and not computed by the rule: its cotangent poisons, never vanishes
    assert np.isnan(np.asarray(jax.grad(lambda A: jnp.sum(program({"A": A, "b": b})["residual"]))(A))).all()
    # without declaring x (read after the zero_ that the program computes), the rule is refused
    undeclared = dataclasses.replace(stage, ignores=lambda **_: {})
    assert "'x'" in traced([undeclared])[0].reverse_refusals()["tests.test_stage_rules.gauss_seidel"]


def make_kernel(scale_by: float):
    """A kernel factory, as mujoco_warp builds kernels per model option."""
    @wp.kernel(module="unique")
    def kernel(a: wp.array(dtype=float), out: wp.array(dtype=float)):
        i = wp.tid()
        out[i] = a[i] * scale_by

    return kernel


def test_a_per_launch_rule_on_a_factory_matches_the_kernels_it_makes_and_no_others():
    matches = launch_matcher(warpnn.StageRule(THIS, "make_kernel", solve_rule, reads=dict, writes=dict,
                                              per_launch=True))
    assert matches(make_kernel(2.0)) and matches(make_kernel(3.0))
    assert not matches(scale) and not matches(gauss_seidel)
    with pytest.raises(TypeError, match="neither a Warp kernel nor a function"):
        launch_matcher(warpnn.StageRule(THIS, "N", solve_rule, reads=dict, writes=dict, per_launch=True))
