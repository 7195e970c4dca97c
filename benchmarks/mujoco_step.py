"""MuJoCo Warp's step in JAX: warpnn's replay against mujoco_warp's own captured graph and MJX ``impl="warp"``.

``python -m benchmarks mujoco_step [--models humanoid aloha] [--nworld 1 1024 8192] [--steps 20] [--out docs/]
[--merge]``

Models: two that mujoco_warp ships in ``mujoco_warp/test_data`` (its own benchmarks use them), ``humanoid``
(27 dofs on a floor, from its first keyframe: contacts and the constraint solver) and ``aloha`` (the ALOHA
bimanual manipulator with a pot: two 6-dof arms with grippers, mesh collisions, which the contact rules do not
cover), and ``arm7``, a 7-dof serial arm with motors, joint damping and limits and no contact (an MJCF written
here); the humanoid and arm7 differentiate. Each world starts from the model's first keyframe (or its default
state) with its own small random joint velocities. For each model and number of worlds it times one rollout of
``--steps`` steps and reports steps per second (worlds x steps / s):

* warpnn fwd: ``jax.jit`` of a ``lax.scan`` over :class:`warpnn_models.mujoco.MujocoStep` (``warpnn.trace`` of
  one ``mujoco_warp.step``) with ``nworld`` worlds: one launch per kernel for all of them, as mujoco_warp;
* warpnn vmap: ``jax.vmap`` of the one-world step over the worlds (up to ``--vmap-up-to``): warpnn's batched
  twins where mujoco_warp's kernels allow them, one launch per world for the others;
* warpnn fwd+bwd: ``jax.value_and_grad`` of the final positions' sum with respect to the initial velocities, or
  the reason reverse mode is refused (the first kernel met backwards; ``MujocoStep.reverse_refusals()`` lists
  all); "bwd cost" is warpnn fwd / warpnn fwd+bwd;
* mujoco_warp captured (GPU): ``mujoco_warp.step`` over ``put_data(nworld=...)``, the rollout captured once with
  ``wp.ScopedCapture`` and replayed with ``wp.capture_launch``; on the CPU, mujoco_warp's Python loop;
* MJX warp: ``mujoco.mjx`` with ``impl="warp"`` (``jax.vmap`` of ``mjx.step``), where the installed MJX runs.

Cases alternate in rounds (``benchmarks.common.time_interleaved``). Writes ``mujoco-step-{gpu,cpu}.{md,json}`` to
``--out`` and prints each row as it is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import warp as wp

import warpnn
from warpnn._io import atomic_write_bytes

from .common import time_interleaved

wp.config.quiet = True

# (file under mujoco_warp/test_data, or an MJCF string; contacts per world, constraint rows per world)
MODELS = {"humanoid": ("humanoid/humanoid.xml", 32, 128), "aloha": ("aloha_pot/scene.xml", 256, 768),
          "arm7": ("<mjcf>", 1, 16)}


def _arm7() -> str:
    """A 7-link serial arm (alternating hinge axes), a motor per joint, damping and limits, contacts off."""
    body = ""
    for k in reversed(range(7)):
        axis = "0 1 0" if k % 2 == 0 else "0 0 1"
        body = (f'<body name="link{k}" pos="{0.0 if k == 0 else 0.2} 0 0"><joint name="j{k}" axis="{axis}" '
                f'damping="0.1" limited="true" range="-2 2"/><geom type="capsule" fromto="0 0 0 0.2 0 0" '
                f'size="0.03" mass="{1.0 - 0.1 * k:.1f}"/>{body}</body>')
    motors = "".join(f'<motor joint="j{k}" gear="5"/>' for k in range(7))
    return (f'<mujoco model="arm7"><option timestep="0.005" iterations="10"><flag contact="disable"/></option>'
            f"<worldbody>{body}</worldbody><actuator>{motors}</actuator></mujoco>")


def _model(name: str):
    import mujoco
    import mujoco_warp

    path, nconmax, njmax = MODELS[name]
    if path == "<mjcf>":
        mjm = mujoco.MjModel.from_xml_string(_arm7())
    else:
        mjm = mujoco.MjModel.from_xml_path(os.path.join(os.path.dirname(mujoco_warp.__file__), "test_data", path))
    mjd = mujoco.MjData(mjm)
    if mjm.nkey:
        mujoco.mj_resetDataKeyframe(mjm, mjd, 0)
    mujoco.mj_forward(mjm, mjd)
    return mjm, mjd, nconmax, njmax


def _start_velocities(mjm, mjd, nworld: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return (mjd.qvel[None, :] + 0.01 * rng.standard_normal((nworld, mjm.nv))).astype(np.float32)


def _warpnn_cases(mjm, mjd, qvel: np.ndarray, nconmax: int, njmax: int, steps: int, vmap_up_to: int) -> dict:
    """warpnn's forward over ``nworld`` worlds (one launch per kernel), its reverse mode, and ``jax.vmap`` of the
    one-world step (batched twins, where mujoco_warp's kernels allow them) up to ``vmap_up_to`` worlds."""
    from warpnn_models.mujoco import MujocoStep, rollout

    nworld = qvel.shape[0]
    step = MujocoStep(mjm, mjd, nworld=nworld, nconmax=nconmax, njmax=njmax)
    state, constants = step.initial_state(), step.constants()
    state["qvel"] = jnp.asarray(qvel)

    def forward(state, constants):
        return rollout(step, state, num_steps=steps, constants=constants)[0]["qpos"]

    def loss(qvel, state, constants):
        return forward({**state, "qvel": qvel}, constants).sum()

    cases = {"warpnn fwd": (jax.jit(forward), (state, constants))}
    value_and_grad = jax.jit(jax.value_and_grad(loss))
    try:  # reverse mode refuses at trace time, before anything runs: the row shows why
        value_and_grad.lower(state["qvel"], state, constants)
        cases["warpnn fwd+bwd"] = (value_and_grad, (state["qvel"], state, constants))
    except TypeError as e:
        cases["warpnn fwd+bwd"] = e
    if 1 < nworld <= vmap_up_to:
        one = MujocoStep(mjm, mjd, nconmax=nconmax, njmax=njmax)
        one_state, one_constants = one.initial_state(), one.constants()
        states = {k: jnp.broadcast_to(v, (nworld, *v.shape)) for k, v in one_state.items()}
        states["qvel"] = jnp.asarray(qvel)[:, None, :]

        def vmapped(states, constants):
            run = lambda s: rollout(one, s, num_steps=steps, constants=constants)[0]["qpos"]  # noqa: E731
            return jax.vmap(run)(states)

        cases["warpnn vmap"] = (jax.jit(vmapped), (states, one_constants))
    return cases


class _MujocoWarpRollout:
    """mujoco_warp's own rollout over ``nworld`` worlds, captured once into a CUDA graph on a GPU."""

    def __init__(self, mjm, mjd, qvel: np.ndarray, nconmax: int, njmax: int, steps: int, device: str):
        import mujoco_warp as mjw

        with wp.ScopedDevice(device):
            self.m = mjw.put_model(mjm)
            self.d = mjw.put_data(mjm, mjd, nworld=qvel.shape[0], nconmax=nconmax, njmax=njmax)
            self.d.qvel.assign(qvel)
        self.steps, self.device, self.graph = steps, device, None

    def _rollout(self):
        import mujoco_warp as mjw

        for _ in range(self.steps):
            mjw.step(self.m, self.d)

    def run(self):
        with wp.ScopedDevice(self.device):
            if self.device == "cpu":
                self._rollout()
            else:
                if self.graph is None:
                    self._rollout()  # (compiles every kernel before the capture)
                    with wp.ScopedCapture() as capture:
                        self._rollout()
                    self.graph = capture.graph
                wp.capture_launch(self.graph)
            wp.synchronize_device(self.device)
        return 0


def _mjx_case(mjm, qvel: np.ndarray, nconmax: int, njmax: int, steps: int):
    """MJX with ``impl="warp"`` (mujoco_warp through one ``wp.jax_callable``), or the reason it does not run."""
    try:
        from mujoco import mjx
    except ImportError as e:
        return ImportError(f"MJX not installed ({e})")
    try:
        mx = mjx.put_model(mjm, impl="warp")
        dx = mjx.make_data(mjm, impl="warp", naconmax=nconmax * qvel.shape[0], njmax=njmax)
        batch = jax.vmap(lambda v: dx.replace(qvel=v))(jnp.asarray(qvel))

        @jax.jit
        def forward(batch):
            body = lambda d, _: (jax.vmap(mjx.step, in_axes=(None, 0))(mx, d), None)  # noqa: E731
            return jax.lax.scan(body, batch, None, length=steps)[0].qpos

        return forward, (batch,)
    except Exception as e:  # noqa: BLE001 - reported in the table
        return e


def run(models, nworlds, steps: int, rounds: int, vmap_up_to: int):
    """Yields one row per model and number of worlds, as it is measured."""
    on_gpu = jax.default_backend() == "gpu"
    device = "cuda:0" if on_gpu else "cpu"
    for name in models:
        mjm, mjd, nconmax, njmax = _model(name)
        for nworld in nworlds:
            qvel = _start_velocities(mjm, mjd, nworld)
            t0 = time.perf_counter()
            with wp.ScopedDevice(device):
                cases = _warpnn_cases(mjm, mjd, qvel, nconmax, njmax, steps, vmap_up_to)
            trace_s = round(time.perf_counter() - t0, 1)
            if on_gpu or nworld <= 64:  # (mujoco_warp's CPU loop over thousands of worlds would dominate the run)
                loop = _MujocoWarpRollout(mjm, mjd, qvel, nconmax, njmax, steps, device)
                cases["mujoco_warp captured" if on_gpu else "mujoco_warp loop"] = (loop.run, ())
            cases["MJX warp"] = _mjx_case(mjm, qvel, nconmax, njmax, steps)
            refused = {k: v for k, v in cases.items() if isinstance(v, Exception)}
            times = time_interleaved({k: v for k, v in cases.items() if k not in refused}, rounds=rounds, per_round=1)
            times.update(refused)
            row = {"model": name, "nv": mjm.nv, "nworld": nworld, "steps": steps, "trace_s": trace_s}
            for key, value in times.items():
                if isinstance(value, Exception):
                    row[key] = f"{type(value).__name__}: {str(value).splitlines()[0][:160]}"
                else:
                    row[key] = round(nworld * steps / value)
            print(json.dumps(row), flush=True)
            del cases
            yield row


_COLUMNS = ("warpnn fwd", "warpnn vmap", "mujoco_warp captured", "mujoco_warp loop", "MJX warp", "warpnn fwd+bwd")


def _short(error: str) -> str:
    """A refusal as its kernel (the JSON keeps the whole message)."""
    if error.startswith("TypeError: Kernel '"):
        return f"refused at `{error.split(chr(39))[1]}`"
    return error


def _setup() -> str:
    """The device and versions a row was measured with (kept in the row, so the table regenerates anywhere)."""
    import mujoco
    import mujoco_warp

    device = jax.devices()[0]
    try:
        from importlib.metadata import version

        mjx = f", mujoco-mjx {version('mujoco-mjx')}"
    except Exception:  # noqa: BLE001 - not installed (the MJX column then says so)
        mjx = ""
    return (f"{device.platform}: {device.device_kind}; jax {jax.__version__}, warp-lang {wp.__version__}, mujoco-warp "
            f"{getattr(mujoco_warp, '__version__', '?')}, mujoco {mujoco.__version__}{mjx}, warpnn launcher "
            f"{warpnn._launch.LAUNCHER.name}")


def _commit() -> str:
    """The warpnn commit measured (``+`` where the checkout had changes), or "" outside a git checkout: rows merged
    from several runs then say which code each timed."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+" if changed else "")


def markdown(rows: list[dict]) -> str:
    columns = [c for c in _COLUMNS if any(c in r for r in rows)]
    setups = list(dict.fromkeys(r.get("setup", "?") for r in rows))
    commands = list(dict.fromkeys(r.get("command", "python -m benchmarks mujoco_step") for r in rows))
    lines = [
        f"# MuJoCo Warp step: warpnn vs mujoco_warp vs MJX ({' / '.join(s.split(';')[0] for s in setups)})",
        "",
        f"Steps per second (worlds x steps / s), a {rows[0]['steps'] if rows else ''}-step rollout; "
        f"{' / '.join(setups)}. " + "; ".join(f"`{c}`" for c in commands) + ". MJX warp runs the copy of "
        "mujoco_warp that mujoco-mjx vendors, not the installed one. A cell with an error names why that case did "
        "not run (reverse mode: the first kernel refused, `MujocoStep.reverse_refusals()` lists all). bwd cost: "
        "warpnn fwd / warpnn fwd+bwd. commit: the warpnn code each row timed.",
        "",
        "| model | nv | worlds | " + " | ".join(columns) + " | warpnn / mujoco_warp | bwd cost | commit |",
        "|---|---|---|" + "---|" * (len(columns) + 3),
    ]
    for r in rows:
        cells = [f"{r[c]:,}" if isinstance(r.get(c), int) else _short(str(r.get(c, ""))) for c in columns]
        base = r.get("mujoco_warp captured", r.get("mujoco_warp loop"))
        ratio = f"{r['warpnn fwd'] / base:.2f}" if isinstance(base, int) and isinstance(r.get("warpnn fwd"), int) else ""
        both = r.get("warpnn fwd+bwd")
        cost = f"{r['warpnn fwd'] / both:.1f}x" if isinstance(both, int) and isinstance(r.get("warpnn fwd"), int) else ""
        lines.append(f"| {r['model']} | {r['nv']} | {r['nworld']:,} | " + " | ".join(cells)
                     + f" | {ratio} | {cost} | {r.get('commit', '')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    on_gpu = jax.default_backend() == "gpu"
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--nworld", type=int, nargs="+", default=[1, 1024, 8192] if on_gpu else [1, 16])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--vmap-up-to", type=int, default=1024,
                        help="also time jax.vmap of the one-world step up to this many worlds")
    parser.add_argument("--out", default="docs")
    parser.add_argument("--merge", action="store_true", help="keep the rows already in the output file that this run "
                        "does not measure again")
    parser.add_argument("--table-only", choices=("gpu", "cpu"), help="measure nothing: rewrite the markdown table from "
                        "the JSON rows already in --out for that device")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.table_only:
        rows = json.loads((out / f"mujoco-step-{args.table_only}.json").read_text())
        atomic_write_bytes(out / f"mujoco-step-{args.table_only}.md", markdown(rows).encode())
        return
    name = f"mujoco-step-{'gpu' if on_gpu else 'cpu'}"
    measured_with = {"setup": _setup(), "commit": _commit(), "command": "python -m benchmarks mujoco_step " + " ".join(
        sys.argv[1:] if argv is None else argv)}
    earlier = json.loads((out / f"{name}.json").read_text()) if args.merge and (out / f"{name}.json").exists() else []
    rows, table = [], earlier
    for row in run(args.models, args.nworld, args.steps, args.rounds, args.vmap_up_to):
        # the tables are rewritten after each row: a run cut short keeps what it measured, and with --merge the
        # earlier rows it did not get to
        rows.append({**row, **measured_with})
        measured = {(r["model"], r["nworld"]) for r in rows}
        kept = [r for r in earlier if (r["model"], r["nworld"]) not in measured]
        table = sorted(kept + rows, key=lambda r: (list(MODELS).index(r["model"]), r["nworld"]))
        atomic_write_bytes(out / f"{name}.json", (json.dumps(table, indent=1) + "\n").encode())
        atomic_write_bytes(out / f"{name}.md", markdown(table).encode())
    print(markdown(table))


if __name__ == "__main__":
    main()
