"""The fuzz's cases: what each one runs, its NumPy reference, and how its outcome is judged.

A case is a JSON-able dict (``kernel``: elementwise | gather | scatter, array shapes and dtypes, index values,
static scalars, launch and output dims, eager or jit, forward or gradient). ``expected`` says from NumPy alone
whether the call is valid (then ``reference`` gives its values) and, if not, whether the default mode claims to
catch it (a trace-time error: wrong dtype or rank, launch bigger than an output written at the thread's own
index, launch beyond Warp's 32-bit limit). ``python -m tests.fuzz_cases CASES.json`` runs a list of cases in
this process and prints one ``RESULT {json}`` line per case as soon as it is done, so that a parent process can
tell which case killed it.
"""

from __future__ import annotations

import json
import sys

import numpy as np

KERNEL_KEYS = {"elementwise": "shifted_scale", "gather": "gather_rows", "scatter": "scatter_pairs"}
TID_LIMIT = 2**31  # wp.tid() is a signed 32-bit coordinate: extents up to 2**31 (Warp 1.19)


def _wrap(i, n):
    """Warp's index rule: -n <= i < n is in range (negative indices count from the end)."""
    return i + n if i < 0 else i


def _in(i, n):
    return -n <= i < n


def expected(case: dict) -> dict:
    """``{"valid": bool, "claimed": bool}``: is the call valid, and if not, does the default mode refuse it."""
    k = case["kernel"]
    dtypes_ok = case["x_dtype"] == "float32" and case.get("idx_dtype", "int32") == "int32"
    ranks_ok = case.get("idx_rank_ok", True)
    if not (dtypes_ok and ranks_ok) or not case["scalar_ok"]:
        return {"valid": False, "claimed": True}
    launch, out = launch_and_output(case)
    if launch > TID_LIMIT:
        return {"valid": False, "claimed": True}
    # Provable from the source: an array accessed at the thread's own index (y[i], idx[i], v[s]) over a launch
    # bigger than that array.
    if k in ("elementwise", "gather") and launch > out:
        return {"valid": False, "claimed": True}
    if (k == "gather" and launch > len(case["idx"])) or (k == "scatter" and launch > case["n"]):
        return {"valid": False, "claimed": True}
    n = case["n"]
    for t in range(launch):
        if k == "elementwise":
            ok = t < out and _in(t + case["shift"], n)
        elif k == "gather":
            idx = case["idx"]
            ok = t < len(idx) and _in(idx[t], n) and t < out
        else:
            pairs = case["pairs"]
            ok = t < n and t < len(pairs) and _in(pairs[t][0], out) and _in(pairs[t][1], out)
        if not ok:
            return {"valid": False, "claimed": False}
    return {"valid": True, "claimed": True}


def launch_and_output(case: dict) -> tuple[int, int]:
    # The bridge's default launch dims: the Warp shape of the first array input (x, or v for the scatter).
    launch = case["launch"] if case["launch"] is not None else case["n"]
    out = case["out"] if case["out"] is not None else launch
    return launch, out


def inputs(case: dict):
    """NumPy inputs (x, and idx / pairs) with the case's dtypes; x's values are fixed by the case's size."""
    n = case["n"]
    x = np.cos(np.arange(n * (3 if case["kernel"] == "gather" else 1), dtype=np.float64)).astype(case["x_dtype"])
    if case["kernel"] == "gather":
        x = x.reshape(n, 3)
        idx = np.asarray(case["idx"], dtype=np.int64).astype(case["idx_dtype"])  # uint32: negative ones wrap
        if not case.get("idx_rank_ok", True):
            idx = idx.reshape(-1, 1)
        return x, idx
    if case["kernel"] == "scatter":
        pairs = np.asarray(case["pairs"], dtype=np.int64).astype(case["idx_dtype"]).reshape(-1, 2)
        if not case.get("idx_rank_ok", True):
            pairs = pairs.reshape(-1)
        return x, pairs
    return (x,)


def reference(case: dict) -> tuple[np.ndarray, np.ndarray]:
    """The output and the gradient of ``sum(weights * output)`` with respect to x, for a valid case."""
    launch, out = launch_and_output(case)
    k, n = case["kernel"], case["n"]
    x = inputs(case)[0].astype(np.float64)
    if k == "elementwise":
        y, g = np.zeros(out), np.zeros(n)
        w = weights(out)
        for t in range(launch):
            j = _wrap(t + case["shift"], n)
            y[t] = case["s"] * x[j]
            g[j] += case["s"] * w[t]
    elif k == "gather":
        y, g = np.zeros((out, 3)), np.zeros((n, 3))
        w = weights(out * 3).reshape(out, 3)
        for t in range(launch):
            j = _wrap(case["idx"][t], n)
            y[t] = case["s"] * x[j]
            g[j] += case["s"] * w[t]
    else:
        y, g = np.zeros(out), np.zeros(n)
        w = weights(out)
        for t in range(launch):
            a, b = (_wrap(p, out) for p in case["pairs"][t])
            y[a] += x[t]
            y[b] -= x[t]
            g[t] += w[a] - w[b]
    return y, g


def weights(size: int) -> np.ndarray:
    return np.sin(1.0 + np.arange(size, dtype=np.float64))


def run(case: dict) -> dict:
    """Run one case through warpnn; returns the outcome: "correct", "error" (clear, expected), "wrong",
    "false error" (an error on a valid call), "unclear error" (not naming the kernel)."""
    import jax
    import jax.numpy as jnp

    import warpnn

    from . import checked_kernels as C

    kernels = {"elementwise": C.shifted_scale, "gather": C.gather_rows, "scatter": C.scatter_pairs}
    f = warpnn.jax_kernel(kernels[case["kernel"]])
    arrays = [jnp.asarray(a) for a in inputs(case)]
    scalar = case["s"] if case["scalar_ok"] else jnp.float32(case["s"]) * jnp.ones(1)
    kw = {}
    if case["launch"] is not None:
        kw["launch_dims"] = case["launch"]
    if case["out"] is not None:
        kw["output_dims"] = case["out"]

    def forward(x, *rest):
        if case["kernel"] == "elementwise":
            return f(x, scalar, case["shift"], **kw)[0]
        if case["kernel"] == "gather":
            return f(x, rest[0], scalar, **kw)[0]
        return f(x, rest[0], **kw)[0]

    def value(*a):
        y = forward(*a)
        if not case["grad"]:
            return y, jnp.zeros(())
        w = jnp.asarray(weights(int(np.prod(y.shape))).reshape(y.shape), y.dtype)
        return y, jax.grad(lambda x: jnp.vdot(w, forward(x, *a[1:])))(a[0])

    exp = expected(case)
    try:
        with warpnn.checked(case["checked"]):
            fn = jax.jit(value) if case["jit"] else value
            y, g = jax.block_until_ready(fn(*arrays))
    except Exception as e:  # noqa: BLE001 - judged below
        message = f"{type(e).__name__}: {e}"
        if exp["valid"]:
            return {"outcome": "false error", "message": message[-600:]}
        named = f"'{KERNEL_KEYS[case['kernel']]}'" in message
        return {"outcome": "error" if named else "unclear error", "message": message[-600:]}
    if not exp["valid"]:
        return {"outcome": "wrong", "message": "no error for an invalid call"}
    ref_y, ref_g = reference(case)
    if not np.allclose(np.asarray(y, np.float64), ref_y, rtol=1e-5, atol=1e-5):
        return {"outcome": "wrong", "message": f"values differ: max |diff| {np.abs(np.asarray(y) - ref_y).max()}"}
    if case["grad"] and not np.allclose(np.asarray(g, np.float64), ref_g, rtol=1e-5, atol=1e-5):
        return {"outcome": "wrong", "message": f"gradients differ: max |diff| {np.abs(np.asarray(g) - ref_g).max()}"}
    return {"outcome": "correct"}


def main(path: str) -> None:
    import warp as wp

    wp.config.log_level = wp.LOG_WARNING  # no banner (wp.config.quiet is gone in Warp 1.19)
    import warpnn

    with open(path) as fh:
        cases = json.load(fh)
    if cases:  # one mode per process: switching modes clears JAX's caches
        warpnn.set_checked(cases[0]["checked"])
    for i, case in enumerate(cases):
        print("RESULT " + json.dumps({"i": i, **run(case)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
