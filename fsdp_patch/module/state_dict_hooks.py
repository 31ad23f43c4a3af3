"""The hooks through which ``state_dict`` and ``load_state_dict`` reach a unit's sharded parameters.

- Saving and loading between a forward and its backward reach the sharded parameters (the main
  weights), not the unsharded ones a unit keeps after forward: those are put back first.
- ``state_dict`` holds, in place of the detached sharded parameters, DTensors over the same
  memory (:meth:`~.sharding.ParameterGroup.state_dict_tensor`), so that writes into them
  (``dcp.load`` into the tensors ``get_model_state_dict`` returned) reach the compute copy at
  the next forward.
- ``load_state_dict(assign=True)`` registers the loaded tensors in place of the sharded
  parameters: their values are taken over at once (the next forward would, too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..sharding import ParameterGroup
from .fsdp_module import owned_modules
from .parameter_placement import Location
from .unit import UnitState

__all__ = ["register_state_dict_hooks"]


def register_state_dict_hooks(module: nn.Module, state: UnitState) -> None:
    """Registers on ``module``, the unit of ``state``, the hooks described above."""
    module.register_load_state_dict_post_hook(lambda module, incompatible: _loaded(state))
    module.register_state_dict_post_hook(_state_dict_aliases(module, state.groups, state.locations))
    module.register_state_dict_pre_hook(lambda *args: state.release_kept_parameters())
    module.register_load_state_dict_pre_hook(lambda *args: state.release_kept_parameters())


def _loaded(state: UnitState) -> None:
    state.placement.adopt_replaced()
    for group in state.groups:
        group.mark_weights_changed()  # a float8 copy's scales are the loaded weights' to compute


def _state_dict_aliases(
    module: nn.Module, groups: list[ParameterGroup], group_locations: list[list[list[Location]]]
) -> Callable[..., None]:
    """A state-dict post-hook putting :meth:`ParameterGroup.state_dict_tensor` in place of the
    detached sharded parameters ``state_dict`` holds, so that writes into them (``dcp.load``
    into the tensors ``get_model_state_dict`` returned) reach the compute copy at the next forward."""
    prefixes = {id(owner): prefix for prefix, owner in owned_modules(module)}
    entries = [
        (prefixes[id(owner)] + name, owner, name, group, index)
        for group, locations in zip(groups, group_locations, strict=True)
        for index, places in enumerate(locations)
        for owner, name in places
        if id(owner) in prefixes  # a unit over several modules: this module's own parameters
    ]

    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for key, owner, name, group, index in entries:
            param = owner._parameters.get(name)
            # keep_vars=True holds the parameter itself; a tensor that replaced it is left alone.
            if (
                param is group.params[index]
                and state_dict.get(prefix + key) is not param
                and prefix + key in state_dict
            ):
                state_dict[prefix + key] = group.state_dict_tensor(index)

    return hook
