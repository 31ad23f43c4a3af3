"""The state a root shares with the units under it for the current iteration.

The root's forward records the order units are entered in (prefetch follows it: forward in that
order, backward in reverse); the first grad reaching a unit queues the root's final callback,
which finishes every unit's backward and installs the grads; reduce-scatters left in flight
while backward goes on are bounded here; an exception that aborted a forward or backward is
found and reset from here. The units themselves are :class:`~.unit.UnitState`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..sharding import ParameterGroup
from .compile_boundary import outside_dynamo
from .training_state import TrainingState

if TYPE_CHECKING:
    from .unit import UnitState

__all__ = ["RootContext"]


class RootContext:
    """State shared by all units under one root for the current iteration."""

    def __init__(self, root: UnitState, states: list[UnitState]) -> None:
        self.root = root
        self.states = states
        # Units in the order the last complete forward first entered them (prefetch follows
        # it: forward in this order, backward in reverse), and the forward being recorded.
        self.order: list[UnitState] = []
        self._position: dict[int, int] = {}  # id(state) -> index in order
        self._recording: dict[int, UnitState] | None = None  # insertion-ordered
        # Groups with reduce-scatters in flight, oldest first (bounded: each holds its packed
        # grads until it completes).
        self._reducing: list[ParameterGroup] = []
        # The autograd graph task the final callback is queued for. A backward nested in it
        # (a reentrant checkpoint's) queues none of its own: the outer backward's callback
        # finishes what the nested one started. Autograd drops queued callbacks when a backward
        # raises; the next forward finds the task still set and resets the iteration.
        self.callback_task: int | None = None

    def queue_final_callback(self) -> None:
        if self.callback_task is not None:
            return
        self.callback_task = torch._C._current_graph_task_id()
        torch.autograd.Variable._execution_engine.queue_callback(self._final_callback)

    @outside_dynamo
    def _final_callback(self) -> None:
        try:
            for state in reversed(self.states):
                state.finish_backward()
            self._reducing.clear()
            for state in self.states:
                for group in state.groups:
                    group.finalize_grads()  # waits for its reduce-scatters first
        finally:
            self.callback_task = None

    # ------------------------------------------------------------------ overlap
    @property
    def in_forward(self) -> bool:
        """Whether the root's forward is running (its units' order being recorded)."""
        return self._recording is not None

    def begin_forward(self) -> None:
        self._recording = {}

    def entered_forward(self, state: UnitState) -> None:
        if self._recording is not None:
            self._recording.setdefault(id(state), state)

    def end_forward(self) -> None:
        if self._recording is not None:
            self.order, self._recording = list(self._recording.values()), None
            self._position = {id(state): index for index, state in enumerate(self.order)}
        self.cancel_prefetches()

    def cancel_prefetches(self) -> None:
        """Frees units gathered ahead that the forward did not reach (the order changed, or an
        exception ended it), after their all-gathers complete."""
        for state in self.states:
            if state.prefetched:
                state.prefetched = False
                if state.training_state is TrainingState.IDLE:
                    state.reshard()

    def neighbours(self, state: UnitState, direction: int, count: int) -> list[UnitState]:
        """Up to ``count`` units after (``direction`` 1) or before (-1) ``state`` in the order."""
        index = self._position.get(id(state))
        if count <= 0 or index is None:
            return []
        if direction > 0:
            return self.order[index + 1 : index + 1 + count]
        return self.order[max(0, index - count) : index][::-1]

    def make_room(self, limit: int) -> None:
        """Before a unit packs its grads for the reduce: moves reduce-scatters in flight on,
        oldest first, until fewer than ``limit`` remain (as FSDP2 reclaims its reduce-scatter
        input buffers before the next), so that with the one about to be issued at most
        ``limit`` hold their packed grads. Moved on: completed, or under HSDP all-reducing over
        the replicas until the grads are finalized
        (:meth:`~..sharding.parameter_group.ParameterGroup.advance_reduce`)."""
        while self._reducing and len(self._reducing) >= limit:
            self._reducing.pop(0).advance_reduce()

    def reducing(self, groups: list[ParameterGroup], limit: int) -> None:
        """Notes groups that issued reduce-scatters; moves the oldest beyond ``limit`` on (a
        unit of several groups, or ``limit`` 0: each completes where it is issued)."""
        self._reducing.extend(g for g in groups if g.reduce_in_flight)
        while len(self._reducing) > limit:
            self._reducing.pop(0).advance_reduce()

    def interrupted(self) -> bool:
        """Whether an exception aborted a forward or backward of this root's units.

        Only meaningful outside a backward pass.
        """
        return self.callback_task is not None or any(s.training_state is not TrainingState.IDLE for s in self.states)

    def reset(self) -> None:
        self.callback_task = None
        self._recording = None
        self._reducing.clear()
        for state in self.states:
            state.reset()
