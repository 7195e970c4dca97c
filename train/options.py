"""``warpnn-train``'s options and the tasks' configurations, without importing JAX or Warp.

The CLI parses and checks every argument with this module alone, so ``--help``, a mistyped flag or an
out-of-range number answers at once, before the seconds that loading JAX and Warp take. A task module
(``warpnn_train.cloth_sysid`` ...) re-exports its configuration dataclass and ``add_arguments`` from here.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ConfigT = TypeVar("ConfigT", bound="DataclassInstance")  # a task's configuration dataclass


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer ``>= minimum``, else a one-line error naming the value."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # what argparse names in "invalid ... value"
    return parse


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number ``> 0``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


STEPS = int_at_least(1)
COUNT = int_at_least(1)
NON_NEGATIVE = int_at_least(0)


def config_from_args(config_type: type[ConfigT], args: Any) -> ConfigT:
    """The default ``config_type()`` (a dataclass) with each field that ``args`` sets (not None) taken from
    ``args``: a task's options are the configuration fields of the same name (``--steps`` sets ``steps``)."""
    given = {field.name: getattr(args, field.name) for field in dataclasses.fields(config_type)
             if getattr(args, field.name, None) is not None}
    return dataclasses.replace(config_type(), **given)


# --------------------------------------------------------------------------------------------------
# The tasks' configurations (defaults) and options.


@dataclasses.dataclass(frozen=True)
class SysIdConfig:
    """The default system-identification task; every field is a CLI option of the same name."""

    rows: int = 10
    cols: int = 10
    spacing: float = 0.1
    mass: float = 0.1
    height: float = 1.5  # no ground in this task; high enough that the stretched cloth stays above y = 0
    dt: float = 4.0e-3
    frames: int = 200
    drag: float = 0.1
    kick: float = 1.0  # std of the initial random velocity (m/s): excites stretch modes so damping shows
    true_stiffness: tuple[float, ...] = (400.0, 200.0, 20.0)
    true_damping: tuple[float, ...] = (2.0, 1.0, 0.2)
    guess_stiffness: tuple[float, ...] = (100.0, 100.0, 100.0)
    guess_damping: tuple[float, ...] = (0.5, 0.5, 0.5)
    steps: int = 250
    lr: float = 0.2
    velocity_weight: float = 1.0
    backend: str = "warp"



@dataclasses.dataclass(frozen=True)
class ControlConfig:
    """The default folding task."""

    rows: int = 6
    cols: int = 6
    spacing: float = 0.1
    mass: float = 0.02
    stiffness: tuple[float, ...] = (200.0, 100.0, 5.0)  # stretch, shear, bend
    damping: tuple[float, ...] = (0.5, 0.25, 0.02)
    dt: float = 4.0e-3
    frames: int = 200
    drag: float = 0.5
    ground_ke: float = 100.0
    ground_kd: float = 1.0
    friction: float = 0.5
    lift: float = 0.03  # target height of the folded edge above the near edge (about two cloth thicknesses)
    max_force: float = 0.5  # per grasped corner and axis (N); one particle weighs 0.2 N
    hidden: int = 64
    batch: int = 8
    eval_batch: int = 16
    position_noise: float = 0.01  # initial in-plane jitter (m)
    velocity_noise: float = 0.1  # initial in-plane velocity (m/s)
    steps: int = 300
    lr: float = 3.0e-3
    backend: str = "warp"



@dataclasses.dataclass(frozen=True)
class GeometryConfig:
    """The default geometry task; the CLI exposes the fields it lists in :func:`add_arguments`."""

    template_points: int = 2048
    target_points: int = 4096
    major: float = 1.0  # torus: distance from the z axis to the tube centre
    minor: float = 0.35  # torus: tube radius
    width: int = 128
    depth: int = 3
    steps: int = 500
    lr: float = 1.0e-2
    loss: str = "warp"  # or "jax": the pure-JAX brute-force Chamfer (same values, for comparison)



@dataclasses.dataclass(frozen=True)
class PushConfig:
    """The default task."""

    cells: int = 4  # cloth of (cells + 1)^2 particles
    cell: float = 0.1  # m
    mass: float = 0.01  # per particle (kg): 0.25 kg in all
    radius: float = 0.02  # particle contact radius (m)
    spring_ke: float = 200.0
    spring_kd: float = 0.5
    tri_ke: float = 50.0
    contact_ke: float = 1.0e3
    contact_kd: float = 5.0
    friction_kf: float = 50.0
    friction_mu: float = 0.5
    dt: float = 2.0e-3
    frames: int = 250
    target: tuple[float, float] = (0.25, 0.15)  # centre-of-mass displacement to reach on the ground (m)
    max_force: float = 1.0  # per corner and axis (N); the cloth weighs 2.5 N, its friction holds up to ~1.2 N
    hidden: int = 32
    batch: int = 8
    eval_batch: int = 8
    position_noise: float = 0.03  # initial in-plane offset (m)
    velocity_noise: float = 0.1  # initial in-plane velocity (m/s)
    steps: int = 80
    lr: float = 1.0e-2


@dataclasses.dataclass(frozen=True)
class ArmConfig:
    """The default MuJoCo task: a 2-link arm's link masses and joint damping from a trajectory of MuJoCo C."""

    timestep: float = 0.01
    frames: int = 150  # rollout steps (1.5 s)
    true_mass: tuple[float, ...] = (1.0, 0.5)  # upper arm, forearm (kg)
    true_damping: tuple[float, ...] = (0.3, 0.15)  # shoulder, elbow (N m s / rad)
    guess_mass: tuple[float, ...] = (0.5, 1.0)
    guess_damping: tuple[float, ...] = (0.05, 0.6)
    steps: int = 400
    lr: float = 0.05
    velocity_weight: float = 0.1


def add_data_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data parallelism")
    g.add_argument("--devices", type=COUNT, default=None,
                   help="split a batch of independent cloths over N devices (data parallel); default: one cloth, "
                        "one device")
    g.add_argument("--cloths-per-device", type=COUNT, default=4, help="cloths per device with --devices")


def add_cloth_arguments(parser: argparse.ArgumentParser) -> None:
    d = SysIdConfig()
    parser.set_defaults(steps=d.steps)
    g = parser.add_argument_group("cloth system identification")
    g.add_argument("--rows", type=int_at_least(2), default=d.rows, help="cloth rows")
    g.add_argument("--cols", type=int_at_least(2), default=d.cols, help="cloth columns")
    g.add_argument("--frames", type=COUNT, default=d.frames, help="simulated steps in the observed trajectory")
    g.add_argument("--dt", type=positive_float, default=d.dt, help="time step (s)")
    g.add_argument("--lr", type=positive_float, default=d.lr,
                   help="Adam peak learning rate (log-parameters, cosine decay)")
    g.add_argument("--backend", choices=["warp", "jax"], default=d.backend,
                   help="simulate with the Warp kernels or their pure-JAX reference")
    add_data_parallel_arguments(parser)


def add_control_arguments(parser: argparse.ArgumentParser) -> None:
    d = ControlConfig()
    parser.set_defaults(steps=d.steps)
    g = parser.add_argument_group("cloth folding control")
    g.add_argument("--frames", type=COUNT, default=d.frames, help="rollout steps")
    g.add_argument("--batch", type=COUNT, default=d.batch, help="rollouts per training step")
    g.add_argument("--lr", type=positive_float, default=d.lr, help="Adam learning rate")
    g.add_argument("--backend", choices=["warp", "jax"], default=d.backend,
                   help="simulate with the Warp kernels (default) or their pure-JAX reference")


def add_geometry_arguments(parser: argparse.ArgumentParser) -> None:
    d = GeometryConfig()
    parser.set_defaults(steps=d.steps)
    g = parser.add_argument_group("geometry (sphere -> torus under Chamfer loss)")
    g.add_argument("--template-points", type=COUNT, default=d.template_points, help="points on the template sphere")
    g.add_argument("--target-points", type=COUNT, default=d.target_points, help="points sampled on the target torus")
    g.add_argument("--width", type=COUNT, default=d.width, help="MLP hidden width")
    g.add_argument("--depth", type=COUNT, default=d.depth, help="MLP hidden layers")
    g.add_argument("--lr", type=positive_float, default=d.lr, help="Adam peak learning rate (cosine decay)")
    g.add_argument("--loss", choices=["warp", "jax"], default=d.loss,
                   help="Chamfer with the Warp kernels (default) or the pure-JAX brute-force reference")


def add_newton_arguments(parser: argparse.ArgumentParser) -> None:
    d = PushConfig()
    parser.set_defaults(steps=d.steps)
    g = parser.add_argument_group("Newton cloth pushing")
    g.add_argument("--frames", type=COUNT, default=d.frames, help="rollout steps")
    g.add_argument("--batch", type=COUNT, default=d.batch, help="initial states per training step (vmapped)")
    g.add_argument("--lr", type=positive_float, default=d.lr, help="Adam learning rate")


def add_mujoco_arguments(parser: argparse.ArgumentParser) -> None:
    d = ArmConfig()
    parser.set_defaults(steps=d.steps)
    g = parser.add_argument_group("MuJoCo arm identification")
    g.add_argument("--frames", type=COUNT, default=d.frames, help="rollout steps of the recorded trajectory")
    g.add_argument("--lr", type=positive_float, default=d.lr, help="Adam peak learning rate (cosine decay)")


# task name -> the function that adds its options to the CLI's parser (see warpnn_train.cli.TASKS)
ADD_ARGUMENTS: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "cloth": add_cloth_arguments,
    "control": add_control_arguments,
    "geometry": add_geometry_arguments,
    "newton": add_newton_arguments,
    "mujoco": add_mujoco_arguments,
}
