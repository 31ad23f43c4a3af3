"""``fully_shard``: turns a module into an FSDP unit over a 1-D device mesh.

What a unit does in forward and backward is in :mod:`fsdp_patch.unit`; at the end of each
backward the root's final callback installs DTensor views of the main grads as the sharded
parameters' ``.grad``. Between iterations the module holds its sharded parameters, and stays
an ordinary module for everything that reads them: ``state_dict``, optimizers, DCP.

Alternatives considered:
    - Wrapping the module in a new object (FSDP1): changes parameter names; we swap the
      module's class instead, as FSDP2 does, so FQNs stay those of the unwrapped model.
    - Casting at every all-gather (FSDP2): costs a cast per forward and per backward; a
      persistent compute copy costs memory and a refresh per optimizer step instead.
    - Counting ``post_accumulate_grad`` hooks to detect the end of a unit's backward: breaks
      when a weight is used more than once; the input-side autograd function does not.
    - Converting the sharded parameters in ``Module._apply`` (``.to()``, ``.float()``) as FSDP2
      does: the main-weight dtype is the policy's and the compute dtype is fixed when the flat
      buffers are built, so a conversion that would change them is refused and one that would
      not leaves them alone (buffers are converted as usual).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from .compile_boundary import outside_dynamo
from .dcp_optimizer_state import track_grad_dtype_mismatch
from .grad_scaler_hint import track_fp16_main_grads
from .mixed_precision import MixedPrecisionPolicy
from .placement import mesh_device, resolve_mesh
from .sharding import ParameterGroup, parameter_group_of, register_group
from .unit import Location, UnitState

__all__ = ["fully_shard", "FSDPModule", "parameter_groups", "unit_name_of"]


class FSDPModule:
    """Mixin added to the class of every module ``fully_shard`` was applied to."""

    _fsdp_state: UnitState

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Forward hooks do not run when forward raises: undo the pre-forward here, so that a
        # failed forward (say, out of memory on a long batch) leaves the sharded parameters in
        # the module and nothing gathered.
        try:
            return super().__call__(*args, **kwargs)  # type: ignore[misc]
        except BaseException:
            self._fsdp_state.abort_forward()
            raise

    @outside_dynamo
    def unshard(self) -> None:
        """All-gathers this unit's parameters ahead of use (they stay sharded in the module)."""
        for group in self._fsdp_state.groups:
            group.invalidate_compute_copy()  # as the root's forward does: unshard may come first
        self._fsdp_state.unshard()

    @outside_dynamo
    def reshard(self) -> None:
        """Frees this unit's unsharded parameters."""
        self._fsdp_state.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Skips (``False``) or resumes the reduce-scatter of grads in backward.

        While skipped, unsharded grads accumulate locally over microbatches; the next backward
        with sync reduce-scatters their sum, like FSDP2's method of the same name.
        """
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"requires_gradient_sync must be a bool, got {requires_gradient_sync!r}")
        for module in _units(self, recurse):
            module._fsdp_state.requires_gradient_sync = requires_gradient_sync

    def set_overlap_limits(
        self,
        *,
        forward_prefetch: int = 1,
        backward_prefetch: int = 1,
        reduce_scatters_in_flight: int = 2,
        recurse: bool = True,
    ) -> None:
        """Bounds the communication that overlaps computation.

        In forward, each unit issues the all-gathers of the next ``forward_prefetch`` units (in
        the order the last forward entered them) before it computes; in backward, of the
        ``backward_prefetch`` units before it. At most that many units are gathered ahead of the
        one computing. ``reduce_scatters_in_flight`` bounds the reduce-scatters left running
        while backward goes on (each holds its unit's packed grads until it completes); all
        complete before backward ends. 0 turns each off: collectives then block as they run.

        Raises:
            TypeError: A limit is not a non-negative int (bool is refused).
        """
        for name, value in (
            ("forward_prefetch", forward_prefetch),
            ("backward_prefetch", backward_prefetch),
            ("reduce_scatters_in_flight", reduce_scatters_in_flight),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise TypeError(f"set_overlap_limits expected {name} to be an int >= 0, got {value!r}")
        for module in _units(self, recurse):
            state = module._fsdp_state
            state.prefetch_depth = {1: forward_prefetch, -1: backward_prefetch}
            state.reduces_in_flight = reduce_scatters_in_flight

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Units whose all-gathers this unit issues when its forward starts (FSDP2's method
        of the same name); overrides the learned order for this unit. ``[]`` prefetches none."""
        self._fsdp_state.explicit_prefetch[1] = _prefetch_targets(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Units whose all-gathers this unit issues when its backward starts (FSDP2's method
        of the same name); overrides the learned order for this unit. ``[]`` prefetches none."""
        self._fsdp_state.explicit_prefetch[-1] = _prefetch_targets(modules, "set_modules_to_backward_prefetch")

    def reset_iter_state(self) -> None:
        """Recovers from an exception that aborted a forward or backward, like FSDP2's method.

        Puts the sharded parameters back into the modules, frees unsharded storage and drops
        the aborted iteration's gradients: unsharded grads, grads accumulated with gradient
        sync off, and the ``.grad`` of groups the aborted backward had partly reduced into
        (those become ``None``). Applies to every unit under this unit's root. The root's next
        forward does this by itself when it finds an aborted iteration; call it to inspect or
        checkpoint the module in between.
        """
        context = self._fsdp_state.context
        if context is None:
            self._fsdp_state.reset()
        else:
            context.reset()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``Module.zero_grad``, after recovering from an aborted backward if there was one.

        A backward that raised leaves units in mid-backward with their unsharded parameters in
        the modules; resetting first makes ``zero_grad`` reach the sharded parameters, as it
        would have without the exception. Between a forward and its backward, units that keep
        their unsharded parameters after forward put the sharded ones back first, for the same
        reason.
        """
        context = self._fsdp_state.context
        if context is not None and torch._C._current_graph_task_id() == -1 and context.interrupted():
            context.reset()
        for module in _units(self, recurse=True):
            module._fsdp_state.release_kept_parameters()
        super().zero_grad(set_to_none)  # type: ignore[misc]

    @property
    def fsdp_parameter_groups(self) -> list[ParameterGroup]:
        """This unit's own parameter groups (not those of FSDP children)."""
        return list(self._fsdp_state.groups)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FSDPModule:
        """``Module.to``/``.float()``/``.cpu()``/``.to_empty`` and the rest, for a sharded module.

        A conversion that keeps every sharded parameter's dtype and device converts the
        buffers as usual and leaves the sharded parameters (the main weights in their flat
        buffers) as they are; ``to_empty`` thus keeps their values, which its contract allows.
        A conversion that would change one is refused before anything is converted.

        Raises:
            ValueError: The conversion would change a sharded parameter's dtype or device.
        """
        if _APPLYING.depth:
            return super()._apply(fn, recurse)  # type: ignore[misc]
        units = [m._fsdp_state for m in self.modules() if isinstance(m, FSDPModule)] if recurse else [self._fsdp_state]  # type: ignore[attr-defined]
        for unit in units:
            for group in unit.groups:
                _check_conversion(fn, group)
        with _sharded_parameters_hidden(units):
            return super()._apply(fn, recurse)  # type: ignore[misc]

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        raise TypeError(_NO_COPY)

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError(_NO_COPY)


def _units(module: FSDPModule, recurse: bool) -> list[FSDPModule]:
    if not recurse:
        return [module]
    return [m for m in module.modules() if isinstance(m, FSDPModule)]  # type: ignore[attr-defined]


def _prefetch_targets(modules: Any, method: str) -> list[UnitState]:
    if not isinstance(modules, (list, tuple)) or not all(isinstance(m, FSDPModule) for m in modules):
        got = type(modules).__name__ if not isinstance(modules, (list, tuple)) else [type(m).__name__ for m in modules]
        raise TypeError(f"{method} expected a list of modules fully_shard was applied to, got {got}")
    return [m._fsdp_state for m in modules]


_NO_COPY = (
    "fully_shard: an FSDP module cannot be deep-copied or pickled: its parameters are shards in "
    "flat buffers tied to a process group (FSDP2 refuses deepcopy too). To copy the weights, read "
    "torch.distributed.checkpoint.state_dict.get_model_state_dict(model) (full_state_dict=True for "
    "unsharded tensors) and load them into a new model, or save with torch.distributed.checkpoint. "
    "For an average of the weights (torch.optim.swa_utils.AveragedModel deep-copies its model), "
    "build the averaged model before fully_shard and shard its .module the same way."
)


class _ApplyDepth(threading.local):
    depth = 0


# Set while an outer FSDP unit runs Module._apply: the units inside it were checked already.
_APPLYING = _ApplyDepth()


def _check_conversion(fn: Callable[[torch.Tensor], torch.Tensor], group: ParameterGroup) -> None:
    # What fn does to a tensor of the sharded parameters' dtype and device: an empty probe
    # costs nothing and tells, without converting the (possibly large) main weights.
    probe = torch.empty(0, dtype=group.main_dtype, device=group.main_weight.device)
    converted = fn(probe)
    if converted.dtype == probe.dtype and converted.device == probe.device:
        return
    raise ValueError(
        f"fully_shard: this conversion would change sharded parameter '{group.names[0]}' from "
        f"{probe.dtype} on {probe.device} to {converted.dtype} on {converted.device}; nothing was converted. "
        "The sharded parameters are the main weights, whose dtype MixedPrecisionPolicy(main_params_dtype=...) "
        f"sets, and the compute dtype ({group.compute_dtype} here) is the module's dtype when fully_shard was "
        "applied: convert the module (model.to(dtype), model.to(device)) before fully_shard, and shard it on the "
        "device it trains on"
    )


@contextmanager
def _sharded_parameters_hidden(units: list[UnitState]) -> Iterator[None]:
    """Takes the sharded parameters out of their modules (``Module._apply`` skips ``None``)."""
    _APPLYING.depth += 1
    for unit in units:
        for group_locations in unit.locations:
            for places in group_locations:
                for owner, name in places:
                    owner._parameters[name] = None
    try:
        yield
    finally:
        _APPLYING.depth -= 1
        for unit in units:
            unit.swap(unsharded=False)


_FSDP_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
    return _FSDP_CLASSES[cls]


def parameter_groups(module: nn.Module) -> list[ParameterGroup]:
    """All parameter groups of the FSDP units in ``module``'s subtree, in module order."""
    return [g for m in module.modules() if isinstance(m, FSDPModule) for g in m._fsdp_state.groups]


def _owned_modules(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``module`` and its descendants, not descending into FSDP children."""
    yield prefix, module
    for name, child in module._modules.items():
        if child is None or isinstance(child, FSDPModule):
            continue
        yield from _owned_modules(child, f"{prefix}{name}.")


def _state_dict_aliases(
    module: nn.Module, groups: list[ParameterGroup], group_locations: list[list[list[Location]]]
) -> Callable[..., None]:
    """A state-dict post-hook putting :meth:`ParameterGroup.state_dict_tensor` in place of the
    detached sharded parameters ``state_dict`` holds, so that writes into them (``dcp.load``
    into the tensors ``get_model_state_dict`` returned) reach the compute copy at the next forward."""
    prefixes = {id(owner): prefix for prefix, owner in _owned_modules(module)}
    entries = [
        (prefixes[id(owner)] + name, owner, name, group, index)
        for group, locations in zip(groups, group_locations, strict=True)
        for index, places in enumerate(locations)
        for owner, name in places
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


def _release_kept_parameters_before_state_dicts(module: nn.Module, state: UnitState) -> None:
    """Saving and loading between a forward and its backward reach the sharded parameters
    (the main weights), not the unsharded ones a unit keeps after forward."""
    module.register_state_dict_pre_hook(lambda *args: state.release_kept_parameters())
    module.register_load_state_dict_pre_hook(lambda *args: state.release_kept_parameters())


def _fsdp_children(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The FSDP units directly below ``module`` (not inside another unit), with their paths."""
    for prefix, owner in _owned_modules(module):
        for name, child in owner._modules.items():
            if isinstance(child, FSDPModule):
                yield f"{prefix}{name}.", child


def _collect_parameters(module: nn.Module) -> tuple[list[nn.Parameter], list[str], dict[int, list[Location]]]:
    params: list[nn.Parameter] = []
    names: list[str] = []
    locations: dict[int, list[Location]] = {}
    for prefix, owner in _owned_modules(module):
        for name, param in owner._parameters.items():
            if param is None:
                continue
            fqn = f"{prefix}{name}"
            if isinstance(param, DTensor) or parameter_group_of(param) is not None:
                raise ValueError(
                    f"parameter '{fqn}' is already sharded by fully_shard on another module; apply "
                    "fully_shard bottom-up (blocks first, then the root), and keep tied parameters "
                    "within one unit"
                )
            if param in _CONSUMED:
                raise ValueError(
                    f"parameter '{fqn}' is tied to {_CONSUMED[param]}; tied parameters must belong "
                    "to one unit (sharding them in two would silently duplicate them): apply "
                    "fully_shard to a module that contains every use of the parameter"
                )
            if id(param) in locations:
                locations[id(param)].append((owner, name))
                continue
            if param.dim() == 0:
                raise ValueError(
                    f"parameter '{fqn}' is 0-dimensional; fully_shard shards along dim 0 and expects "
                    "at least 1 dimension (store it with shape (1,))"
                )
            if not param.is_floating_point():
                raise ValueError(f"parameter '{fqn}' has dtype {param.dtype}; expected a floating-point dtype")
            params.append(param)
            names.append(fqn)
            locations[id(param)] = [(owner, name)]
    return params, names, locations


# Group -> the fully qualified name of the unit (the fully_shard-ed module) holding it, from the
# outermost unit as the group's parameter names are; "" for that unit. Weak: the unit owns its groups.
_UNIT_NAME: WeakIdKeyDictionary = WeakIdKeyDictionary()


def unit_name_of(group: ParameterGroup) -> str:
    """The fully qualified name of the unit holding ``group`` (``""`` for the root), from the
    outermost unit up the tree, as :attr:`ParameterGroup.names` are."""
    return _UNIT_NAME.get(group, "")


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    """Moves the unit's own buffers to ``device``; buffers on the meta device stay there, for
    ``to_empty`` to materialize with the rest of a meta-built model (see :func:`fully_shard`)."""
    for _, owner in _owned_modules(module):
        for name, buffer in owner._buffers.items():
            if buffer is not None and buffer.device != device and not buffer.is_meta:
                owner._buffers[name] = buffer.to(device)


# Original parameter -> FQN, for parameters that a unit replaced; a later unit that still
# finds one of them registered somewhere has found a parameter tied across units.
_CONSUMED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | None = None,
) -> nn.Module:
    """Shards ``module``'s parameters over a 1-D mesh with fp32 main weights.

    Apply bottom-up: each block first, then the root. A unit owns the parameters that no FSDP
    child owns. A module built under ``torch.device("meta")`` is sharded without being
    materialized: its shards are allocated on the mesh's device (zeros) for an initialization
    after ``fully_shard`` (``to_empty(device=...)``, then ``reset_parameters()``, ``nn.init``
    or ``copy_`` on the sharded parameters), as FSDP2 supports; an all-gather casts them anew. Its parameters become DTensor ``Shard(0)`` parameters (split as ``torch.chunk``
    splits) holding the main weights, with ``grad_dtype`` set to the main-grad dtype; the
    module's class becomes a subclass of :class:`FSDPModule`.

    Args:
        module: Module to shard in place.
        mesh: 1-D device mesh; ``None`` builds one over the default process group.
        mp_policy: Dtypes of main weights and main grads; ``None`` means the defaults.
        reshard_after_forward: ``True``: free the unsharded parameters after forward and
            gather again for backward. ``False``: keep them, registered in the module, until
            the end of the unit's backward (code between forward and backward sees plain
            tensors, as inside forward). ``None`` (the default, as FSDP2's): ``False`` for the
            root of the forward, whose backward starts at once, ``True`` for every other unit.
            A forward without grad (``torch.no_grad()``, evaluation) always frees them.

    Returns:
        ``module``, now an :class:`FSDPModule`.

    Raises:
        ValueError: ``fully_shard`` was already applied to ``module``, a parameter is tied
            across units, 0-dimensional or not floating point.
        NotImplementedError: ``mesh`` is not 1-D.
        TypeError: An argument has the wrong type.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expected an nn.Module, got {type(module)!r}")
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}; apply it once per module")
    if mp_policy is None:
        mp_policy = MixedPrecisionPolicy()
    elif not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard expected mp_policy to be a MixedPrecisionPolicy or None, got {type(mp_policy)!r}")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise TypeError(
            f"fully_shard expected reshard_after_forward to be a bool or None, got {reshard_after_forward!r}"
        )
    mesh = resolve_mesh(mesh)
    device = mesh_device(mesh)

    params, names, locations = _collect_parameters(module)
    by_key: dict[tuple[torch.dtype, bool], list[int]] = {}
    for index, param in enumerate(params):
        by_key.setdefault((param.dtype, param.requires_grad), []).append(index)

    # Everything that can fail happens before the module is touched.
    groups: list[ParameterGroup] = []
    group_locations: list[list[list[Location]]] = []
    for indices in by_key.values():
        groups.append(
            ParameterGroup([params[i] for i in indices], [names[i] for i in indices], mesh, mp_policy, device)
        )
        group_locations.append([locations[id(params[i])] for i in indices])

    state = UnitState(module, mesh, mp_policy, reshard_after_forward, groups, group_locations)
    state.swap(unsharded=False)
    for group in groups:
        register_group(group)
        if group.grads_dtype == torch.float16:
            track_fp16_main_grads(group)
        if group.grads_dtype != group.main_dtype:
            track_grad_dtype_mismatch(group)
    for param, name in zip(params, names, strict=True):
        _CONSUMED[param] = f"parameter '{name}' of an already fully_shard-ed {type(module).__name__}"
    # Units are built bottom-up, each naming its parameters from itself; a parent prefixes its
    # children's names, so error messages name parameters from the outermost unit.
    for prefix, child in _fsdp_children(module):
        for group in parameter_groups(child):
            group.names = [prefix + name for name in group.names]
            inner = _UNIT_NAME.get(group, "")
            _UNIT_NAME[group] = prefix + inner if inner else prefix[:-1]
    _move_buffers(module, device)
    module._fsdp_state = state  # type: ignore[assignment]
    module.register_forward_pre_hook(state.pre_forward, with_kwargs=True)
    module.register_forward_hook(state.post_forward)
    # load_state_dict(assign=True) registers the loaded tensors in place of the sharded
    # parameters: take their values over at once (the next forward would, too).
    module.register_load_state_dict_post_hook(lambda module, incompatible: state.adopt_replaced_parameters())
    module.register_state_dict_post_hook(_state_dict_aliases(module, groups, group_locations))
    _release_kept_parameters_before_state_dicts(module, state)
    module.__class__ = _fsdp_class(type(module))
    return module
