"""Which parameters a unit's modules hold, and tensors that took a sharded parameter's place.

Between iterations a unit's modules hold its groups' sharded parameters (DTensors over the main
weights); while the unit computes they hold the unsharded ones (views of the all-gathered
storage). :class:`ParameterPlacement` swaps one set for the other in place, in the modules'
``_parameters`` at every place a parameter is registered (a shared parameter has several), and
takes over the values of tensors that stand where a sharded parameter was expected
(``load_state_dict(assign=True)``, attribute assignment): they go into the group buffers, and the
groups' own parameters stay the modules'.

When to swap is the unit's (:class:`~.unit.UnitState`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ..sharding import ParameterGroup

__all__ = ["Location", "ParameterPlacement", "Replacement"]

Location = tuple[nn.Module, str]
Replacement = tuple[ParameterGroup, int, Any]  # (group, index in the group, what stood there)


class ParameterPlacement:
    """Where a unit's parameters live in the module tree, and which set is there now.

    Args:
        groups: The unit's parameter groups.
        locations: Per group, per parameter, every ``(module, name)`` it is registered under.

    Attributes:
        unsharded: Whether the modules hold the unsharded parameters.
    """

    def __init__(self, groups: Sequence[ParameterGroup], locations: list[list[list[Location]]]) -> None:
        self.groups = groups
        self.locations = locations
        self.unsharded = False

    def swap(self, unsharded: bool, sync_requires_grad: bool = False) -> list[Replacement]:
        """Registers the unsharded (or sharded) parameters in the modules.

        With ``sync_requires_grad`` an unsharded parameter trains exactly when its sharded one
        does (``requires_grad_`` after ``fully_shard`` is honoured from the next forward on).

        Returns:
            What stood where a sharded parameter was expected when swapping the unsharded
            ones in: tensors that replaced sharded parameters (see :meth:`adopt`).
        """
        replaced: list[Replacement] = []
        for group, group_locations in zip(self.groups, self.locations, strict=True):
            params = group.unsharded_params if unsharded else group.params
            for index, (param, places) in enumerate(zip(params, group_locations, strict=True)):
                if sync_requires_grad:
                    wanted = group.params[index].requires_grad
                    if param.requires_grad is not wanted:
                        param.requires_grad_(wanted)
                for owner, name in places:
                    if unsharded:
                        current = owner._parameters.get(name)
                        if current is not group.params[index] and current is not param:
                            replaced.append((group, index, current))
                    owner._parameters[name] = param
        self.unsharded = unsharded
        return replaced

    def adopt_replaced(self) -> None:
        """:meth:`adopt` for whatever replaced sharded parameters in the modules now."""
        replaced: list[Replacement] = []
        for group, group_locations in zip(self.groups, self.locations, strict=True):
            for index, (param, places) in enumerate(zip(group.params, group_locations, strict=True)):
                for owner, name in places:
                    current = owner._parameters.get(name)
                    if current is not param:
                        replaced.append((group, index, current))
        if replaced:
            self.adopt(replaced)
            self.swap(unsharded=False)

    def adopt(self, replaced: list[Replacement]) -> None:
        """Takes over the values of tensors that replaced sharded parameters in the module.

        ``load_state_dict(assign=True)`` and attribute assignment put new tensors where the
        sharded parameters were; their values go into the group buffers and the groups' own
        parameters stay the modules' parameters. If any replacement is unusable, the modules
        get the sharded parameters back and nothing is adopted.

        Raises:
            TypeError, ValueError: A replacement is not a floating-point tensor of the
                parameter's global shape (see :meth:`ParameterGroup.check_replacement`).
        """
        try:
            for group, index, current in replaced:
                group.check_replacement(index, current)
        except BaseException:
            self.swap(unsharded=False)
            raise
        for group, index, current in replaced:
            group.adopt(index, current)
