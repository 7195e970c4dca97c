"""What a traced simulator step must carry from one step to the next: shared by NewtonStep and MujocoStep."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def trace_carrying(owner: str, what: str, given: Sequence[str] | None, default: Sequence[str],
                   trace: Callable[[tuple[str, ...]], None],
                   read_back: Callable[[tuple[str, ...]], list[str]]) -> tuple[str, ...]:
    """Trace a step (``trace(fields)``) over the state fields it must carry, and return them.

    ``read_back(fields)`` names the other arrays the traced step writes and reads back the next step (from
    ``WarpProgram.frozen_state``): a replay would restart each from its trace-time value every step. With
    ``given`` fields, such an array is an error naming it; by default (``given`` None) ``default`` and every
    such array are carried (a second trace).
    """
    fields = tuple(default if given is None else given)
    trace(fields)
    missing = read_back(fields)
    if missing and given is not None:
        raise ValueError(
            f"{owner}: the step writes {what} {missing} and reads them back the next step, but they are not in "
            f"state_fields={list(fields)}: every replayed step would restart from their values when the step was "
            "traced. Add them to state_fields (or leave state_fields out: the default carries every such array)."
        )
    if missing:
        fields += tuple(missing)
        trace(fields)
    return fields
