"""Where a unit is in an iteration: the states of FSDP2's ``TrainingState`` (the transitions
between them are in :mod:`fsdp_patch.module.unit`)."""

from __future__ import annotations

import enum

__all__ = ["TrainingState"]


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
