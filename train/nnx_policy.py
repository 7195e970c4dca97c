"""What the NNX policy tasks (``control``, ``newton``) share: training a Flax NNX policy with Adam on a batch
loss over sampled initial states (resumable, through :func:`warpnn_train.common.train_loop`), its msgpack
checkpoints, and the part of ``run`` that trains, checkpoints and reports the training metrics.

A task brings its policy, its ``sample_initial_states`` and its ``batch_loss``; everything about the
optimiser, the held-out evaluation, the random key, resuming and checkpointing is here, once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, serialization

from . import common

CHECKPOINT = "checkpoint.msgpack"

# The held-out batch and the training keys are drawn from the seed: the same seed, the same run.
EVAL_KEY_OFFSET = 10_000

Sample = Callable[[Any, int], tuple[jax.Array, jax.Array]]  # (key, batch) -> (x0s, v0s)
BatchLoss = Callable[[nnx.Module, jax.Array, jax.Array], jax.Array]  # (policy, x0s, v0s) -> scalar loss


def train(
    policy: nnx.Module,
    *,
    seed: int,
    steps: int,
    lr: float,
    batch: int,
    eval_batch: int,
    sample_initial_states: Sample,
    batch_loss: BatchLoss,
    untrained: Callable[[], nnx.Module],
    desc: str,
    progress: bool = True,
    resume_from: dict | None = None,
    save: Callable[[dict[str, Any]], None] | None = None,
    checkpoint_every: int = 0,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Train ``policy`` in place with Adam; returns losses, held-out losses before/after and steps/s.

    Each step draws ``batch`` initial states with ``sample_initial_states(key, batch)`` and takes an Adam step
    (learning rate ``lr``, gradients clipped to norm 1) on ``batch_loss(policy, x0s, v0s)``. The held-out
    loss is ``batch_loss`` on ``eval_batch`` states drawn once from the seed; ``untrained()`` rebuilds the
    policy as initialised (for the held-out loss before training, when resuming).

    ``resume_from`` (a :func:`read_checkpoint` dict) continues an earlier call: its policy parameters,
    optimiser state, random key, step and losses; ``save(checkpoint_dict)`` is called every
    ``checkpoint_every`` steps and when training stops early (after step ``stop_after``).

    Returns:
        ``losses`` (of every step, the resumed ones included), ``eval_initial``, ``eval_final``,
        ``steps_per_s`` (of the steps run in this call), ``optimizer`` and ``key`` (for the final checkpoint).
    """
    # Clipping guards against the rare exploding gradient of a long contact-rich rollout.
    optimizer = nnx.Optimizer(policy, optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr)), wrt=nnx.Param)
    eval_x0, eval_v0 = sample_initial_states(jax.random.PRNGKey(EVAL_KEY_OFFSET + seed), eval_batch)
    evaluate = nnx.jit(lambda policy: batch_loss(policy, eval_x0, eval_v0))

    @nnx.jit
    def update(policy, optimizer, key):
        x0s, v0s = sample_initial_states(key, batch)
        value, grads = nnx.value_and_grad(lambda p: batch_loss(p, x0s, v0s))(policy)
        optimizer.update(policy, grads)
        return value

    # The held-out loss of the untrained policy (deterministic from the seed: rebuilt when resuming).
    eval_initial = float(evaluate(policy if resume_from is None else untrained()))
    key, start, losses = jax.random.PRNGKey(seed), 0, []
    if resume_from is not None:
        restore(policy, optimizer, resume_from)
        key, start = jnp.asarray(resume_from["key"], jnp.uint32), int(resume_from["step"])
        losses = common.losses_list(resume_from["losses"], start)

    def step(key):
        key, sub = jax.random.split(key)
        return key, update(policy, optimizer, sub)

    def checkpoint(key, done: int, new_losses: list[float]) -> None:
        assert save is not None  # only passed to the loop with a save
        save(checkpoint_dict(policy, done, optimizer=optimizer, key=key, losses=losses + new_losses, steps=steps))

    key, new_losses, steps_per_s = common.train_loop(
        step, key, steps, desc, start=start, progress=progress,
        checkpoint=checkpoint if save is not None else None, checkpoint_every=checkpoint_every, stop_after=stop_after)
    eval_final = float(evaluate(policy))
    return {"losses": losses + new_losses, "eval_initial": eval_initial, "eval_final": eval_final,
            "steps_per_s": steps_per_s, "optimizer": optimizer, "key": key}


def task_trainer(sample_initial_states: Callable[..., tuple[jax.Array, jax.Array]],
                 batch_loss: Callable[..., jax.Array], make_policy: Callable[[Any, int], nnx.Module],
                 desc: str) -> Callable[..., dict[str, Any]]:
    """A task's ``train(task, policy, seed, steps=None, progress=True, *, resume_from=None, save=None,
    checkpoint_every=0, stop_after=None)``: :func:`train` with the task's own functions bound to ``task``.

    ``sample_initial_states(task, key, batch)``, ``batch_loss(task, policy, x0s, v0s)`` and
    ``make_policy(task, seed)`` are the task module's; ``task.config`` has ``steps``, ``lr``, ``batch`` and
    ``eval_batch``; ``desc`` labels the progress bar.
    """

    def train_task(task: Any, policy: nnx.Module, seed: int, steps: int | None = None, progress: bool = True, *,
                   resume_from: dict | None = None, save: Callable[[dict[str, Any]], None] | None = None,
                   checkpoint_every: int = 0, stop_after: int | None = None) -> dict[str, Any]:
        """Train ``policy`` in place with Adam; returns losses, held-out losses before/after and steps/s.

        ``resume_from`` (a :func:`read_checkpoint` dict) continues an earlier call: its policy parameters,
        optimiser state, random key, step and losses; ``save(checkpoint_dict)`` is called every
        ``checkpoint_every`` steps and when training stops early (after step ``stop_after``). See
        :func:`warpnn_train.nnx_policy.train`.
        """
        c = task.config
        return train(
            policy, seed=seed, steps=c.steps if steps is None else steps, lr=c.lr, batch=c.batch,
            eval_batch=c.eval_batch, sample_initial_states=lambda key, n: sample_initial_states(task, key, n),
            batch_loss=lambda p, x0s, v0s: batch_loss(task, p, x0s, v0s), untrained=lambda: make_policy(task, seed),
            desc=desc, progress=progress, resume_from=resume_from, save=save, checkpoint_every=checkpoint_every,
            stop_after=stop_after)

    return train_task


def train_in(out: common.RunDir, policy: nnx.Module, steps: int,
             train_fn: Callable[..., dict[str, Any]]) -> tuple[dict[str, Any], dict | None]:
    """Train in the run folder ``out``: resume from its checkpoint under ``--resume``, checkpoint there as
    ``--checkpoint-every`` and ``--stop-after`` say, and write the final checkpoint after ``steps`` steps.

    ``train_fn(resume_from=, save=, checkpoint_every=, stop_after=)`` is the task's training (a :func:`train`
    with the task bound). Returns its result and the checkpoint it resumed from (None for a fresh run).
    """
    resume_from = common.read_checkpoint(out / CHECKPOINT, read_checkpoint) if out.resume else None

    def save(tree: dict[str, Any]) -> None:
        common.atomic_write_bytes(out / CHECKPOINT, serialization.to_bytes(tree))

    result = train_fn(resume_from=resume_from, save=save, checkpoint_every=out.checkpoint_every,
                      stop_after=out.stop_after)
    save(checkpoint_dict(policy, steps, optimizer=result["optimizer"], key=result["key"], losses=result["losses"],
                         steps=steps))
    return result, resume_from


def training_metrics(result: dict[str, Any], steps: int, resume_from: dict | None) -> dict[str, Any]:
    """The metrics.json entries every policy task reports about its training (from a :func:`train` result)."""
    return {
        "initial_loss": result["losses"][0],
        "final_loss": result["losses"][-1],
        "eval_initial_loss": result["eval_initial"],
        "eval_final_loss": result["eval_final"],
        "loss_reduction": result["eval_initial"] / result["eval_final"],
        "steps": steps,
        "resumed_from_step": int(resume_from["step"]) if resume_from is not None else None,
        "steps_per_s": result["steps_per_s"],
    }


# --------------------------------------------------------------------------------------------------
# Checkpoints: policy-agnostic (any NNX module), Flax msgpack.


def checkpoint_dict(policy: nnx.Module, step: int, *, optimizer: nnx.Optimizer | None = None, key=None,
                    losses: list[float] | tuple[float, ...] = (), steps: int = 0) -> dict[str, Any]:
    """What a checkpoint holds: policy parameters, steps done and, to resume training, the optimiser state,
    the random key and the losses so far (NaN-padded to ``steps``)."""
    tree: dict[str, Any] = {"params": nnx.to_pure_dict(nnx.state(policy, nnx.Param)), "step": step}
    if optimizer is not None:
        tree["opt_state"] = nnx.to_pure_dict(nnx.state(optimizer))
        tree["key"] = np.asarray(key, np.uint32)
        tree["losses"] = common.losses_array(list(losses), steps)
    return tree


def checkpoint_bytes(policy: nnx.Module, step: int, **training_state) -> bytes:
    """The policy's parameters and the step count (and, given ``optimizer``, ``key``, ``losses`` and
    ``steps``, what resuming needs) as Flax msgpack bytes."""
    return serialization.to_bytes(checkpoint_dict(policy, step, **training_state))


def read_checkpoint(path) -> dict[str, Any]:
    """A checkpoint written by a task's ``run`` as nested dicts of arrays (no template needed)."""
    with open(path, "rb") as f:
        return serialization.msgpack_restore(f.read())


def restore(policy: nnx.Module, optimizer: nnx.Optimizer | None, checkpoint: dict[str, Any]) -> None:
    """Load a :func:`read_checkpoint` dict into ``policy`` (and ``optimizer``), which must match its shapes."""
    state = nnx.state(policy, nnx.Param)
    template = nnx.to_pure_dict(state)
    nnx.replace_by_pure_dict(state, serialization.from_state_dict(template, checkpoint["params"]))
    nnx.update(policy, state)
    if optimizer is not None:
        opt_state = nnx.state(optimizer)
        template = nnx.to_pure_dict(opt_state)
        nnx.replace_by_pure_dict(opt_state, serialization.from_state_dict(template, checkpoint["opt_state"]))
        nnx.update(optimizer, opt_state)


def load_checkpoint(path, policy: nnx.Module) -> int:
    """Load parameters written by a task's ``run`` into ``policy`` (same architecture); returns the step count."""
    checkpoint = read_checkpoint(path)
    restore(policy, None, checkpoint)
    return int(checkpoint["step"])
