"""``fully_shard``: turns a module into an FSDP unit over a 1-D device mesh.

Lifecycle of a unit's parameters within one training iteration:

1. pre-forward: all-gather the compute copy of each group into the unsharded parameters and
   swap them into the module;
2. post-forward: swap the sharded parameters back, free the unsharded storage when
   ``reshard_after_forward`` (or when no backward can follow);
3. pre-backward (first grad reaching the unit's outputs): all-gather again if freed;
4. post-backward (grads of the unit's inputs computed, or the root's final callback):
   reduce-scatter the unsharded grads into the main-grad buffers, free the unsharded storage;
5. end of backward (root's final callback): install DTensor views of the main grads as the
   sharded parameters' ``.grad``.

Alternatives considered:
    - Wrapping the module in a new object (FSDP1): changes parameter names; we swap the
      module's class instead, as FSDP2 does, so FQNs stay those of the unwrapped model.
    - Casting at every all-gather (FSDP2): costs a cast per forward and per backward; a
      persistent compute copy costs memory and a refresh per optimizer step instead.
    - Counting ``post_accumulate_grad`` hooks to detect the end of a unit's backward: breaks
      when a weight is used more than once; the input-side autograd function does not.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from .mixed_precision import MixedPrecisionPolicy
from .parameter_group import ParameterGroup, parameter_group_of
from .placement import mesh_device, resolve_mesh

__all__ = ["fully_shard", "FSDPModule", "parameter_groups"]

_Location = tuple[nn.Module, str]


class _RootContext:
    """State shared by all units under one root for the current iteration."""

    def __init__(self, root: "_UnitState", states: list["_UnitState"]) -> None:
        self.root = root
        self.states = states
        # The autograd graph task the final callback is queued for. Per task rather than a
        # flag: autograd drops queued callbacks when a backward raises, and a flag left set
        # would keep every later backward from queuing one (no grads installed, ever).
        self.callback_task: int | None = None

    def queue_final_callback(self) -> None:
        task = torch._C._current_graph_task_id()
        if self.callback_task == task:
            return
        self.callback_task = task
        torch.autograd.Variable._execution_engine.queue_callback(self._final_callback)

    def _final_callback(self) -> None:
        try:
            for state in reversed(self.states):
                state.post_backward(final=True)
            for state in self.states:
                for group in state.groups:
                    group.finalize_grads()
        finally:
            self.callback_task = None

    def interrupted(self) -> bool:
        """Whether an exception aborted a forward or backward of this root's units."""
        backward_aborted = self.callback_task is not None and self.callback_task != torch._C._current_graph_task_id()
        return backward_aborted or any(state.in_forward for state in self.states)

    def reset(self) -> None:
        self.callback_task = None
        for state in self.states:
            state.reset()


class _UnitState:
    """Per-unit state: groups, where their parameters live in the module tree, hook logic."""

    def __init__(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        policy: MixedPrecisionPolicy,
        reshard_after_forward: bool,
        groups: list[ParameterGroup],
        locations: list[list[list[_Location]]],
    ) -> None:
        self.module = module
        self.mesh = mesh
        self.policy = policy
        self.reshard_after_forward = reshard_after_forward
        self.groups = groups
        self.locations = locations
        self.requires_gradient_sync = True
        self.context: _RootContext | None = None
        self.pending_post_backward = 0
        self.in_forward = False  # between pre- and post-forward: the unsharded params are swapped in
        self.forward_registered_backward = False  # this forward counted a pending post-backward

    def _swap(self, unsharded: bool) -> None:
        for group, group_locations in zip(self.groups, self.locations):
            params = group.unsharded_params if unsharded else group.params
            for param, places in zip(params, group_locations):
                for owner, name in places:
                    owner._parameters[name] = param

    def lazy_init_as_root(self) -> None:
        states = [m._fsdp_state for m in self.module.modules() if isinstance(m, FSDPModule)]
        context = _RootContext(self, states)
        for state in states:
            state.context = context

    def unshard(self) -> None:
        for group in self.groups:
            group.unshard()

    def reshard(self) -> None:
        for group in self.groups:
            group.reshard()

    def reset(self) -> None:
        """Forgets an iteration an exception aborted: sharded params back in the module,
        unsharded storage and grads dropped, grads the aborted backward had partly reduced
        discarded (see :meth:`ParameterGroup.reset_iter_state`)."""
        self.pending_post_backward = 0
        self.in_forward = False
        self.forward_registered_backward = False
        self._swap(unsharded=False)
        for group in self.groups:
            group.reset_iter_state()

    def abort_forward(self) -> None:
        """Undoes the pre-forward of a forward that raised (the post-forward never ran)."""
        if not self.in_forward:
            return
        self.in_forward = False
        self._swap(unsharded=False)
        self.reshard()
        if self.forward_registered_backward:
            self.forward_registered_backward = False
            self.pending_post_backward -= 1  # its autograd graph went with the exception

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.context is None:
            self.lazy_init_as_root()
        elif self.context.root is self and self.context.interrupted():
            self.context.reset()
        self.unshard()
        self._swap(unsharded=True)
        self.in_forward = True
        if torch.is_grad_enabled():
            # Also for a frozen unit: backward through it re-gathers its weights to compute its
            # inputs' grads, and its post-backward is what frees them again.
            self.pending_post_backward += 1
            self.forward_registered_backward = True
            args, kwargs = _register_post_backward(self, args, kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        self._swap(unsharded=False)
        self.in_forward = False
        self.forward_registered_backward = False
        grad_enabled = torch.is_grad_enabled()
        if self.reshard_after_forward or not grad_enabled:
            self.reshard()
        if grad_enabled:
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, self._pre_backward, mode="any")
        return output

    def _pre_backward(self, grad: torch.Tensor) -> None:
        if self.context is not None:
            self.context.queue_final_callback()
        self.unshard()

    def post_backward(self, final: bool = False) -> None:
        if self.pending_post_backward <= 0:
            return
        self.pending_post_backward = 0 if final else self.pending_post_backward - 1
        if self.requires_gradient_sync:
            for group in self.groups:
                if group.requires_grad:
                    group.reduce_grads()
        self.reshard()


class _RegisterPostBackward(torch.autograd.Function):
    """Identity on the unit's inputs whose backward marks the end of the unit's backward."""

    @staticmethod
    def forward(ctx: Any, state: _UnitState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.state.post_backward()
        return (None, *grads)


def _register_post_backward(state: _UnitState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    flat, spec = tree_flatten((args, kwargs))
    indices = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not indices:
        return args, kwargs
    outputs = _RegisterPostBackward.apply(state, *(flat[i] for i in indices))
    for i, out in zip(indices, outputs):
        flat[i] = out
    return tree_unflatten(flat, spec)


class FSDPModule:
    """Mixin added to the class of every module ``fully_shard`` was applied to."""

    _fsdp_state: _UnitState

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Forward hooks do not run when forward raises: undo the pre-forward here, so that a
        # failed forward (say, out of memory on a long batch) leaves the sharded parameters in
        # the module and nothing gathered.
        try:
            return super().__call__(*args, **kwargs)  # type: ignore[misc]
        except BaseException:
            self._fsdp_state.abort_forward()
            raise

    def unshard(self) -> None:
        """All-gathers this unit's parameters ahead of use (they stay sharded in the module)."""
        self._fsdp_state.unshard()

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
        modules = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        for module in modules:
            if isinstance(module, FSDPModule):
                module._fsdp_state.requires_gradient_sync = requires_gradient_sync

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

    @property
    def fsdp_parameter_groups(self) -> list[ParameterGroup]:
        """This unit's own parameter groups (not those of FSDP children)."""
        return list(self._fsdp_state.groups)


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


def _fsdp_children(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The FSDP units directly below ``module`` (not inside another unit), with their paths."""
    for prefix, owner in _owned_modules(module):
        for name, child in owner._modules.items():
            if isinstance(child, FSDPModule):
                yield f"{prefix}{name}.", child


def _collect_parameters(module: nn.Module) -> tuple[list[nn.Parameter], list[str], dict[int, list[_Location]]]:
    params: list[nn.Parameter] = []
    names: list[str] = []
    locations: dict[int, list[_Location]] = {}
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
            if param.is_meta:
                raise ValueError(f"parameter '{fqn}' is on the meta device; materialize it before fully_shard")
            params.append(param)
            names.append(fqn)
            locations[id(param)] = [(owner, name)]
    return params, names, locations


# Original parameter -> FQN, for parameters that a unit replaced; a later unit that still
# finds one of them registered somewhere has found a parameter tied across units.
_CONSUMED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shards ``module``'s parameters over a 1-D mesh with fp32 main weights.

    Apply bottom-up: each block first, then the root. A unit owns the parameters that no FSDP
    child owns. Its parameters become DTensor ``Shard(0)`` parameters (split as ``torch.chunk``
    splits) holding the main weights, with ``grad_dtype`` set to the main-grad dtype; the
    module's class becomes a subclass of :class:`FSDPModule`.

    Args:
        module: Module to shard in place.
        mesh: 1-D device mesh; ``None`` builds one over the default process group.
        mp_policy: Dtypes of main weights and main grads; ``None`` means the defaults.
        reshard_after_forward: Free the unsharded parameters after forward and gather again
            for backward.

    Returns:
        ``module``, now an :class:`FSDPModule`.

    Raises:
        ValueError: ``fully_shard`` was already applied to ``module``, a parameter is tied
            across units, 0-dimensional, not floating point or on the meta device.
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
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"fully_shard expected reshard_after_forward to be a bool, got {reshard_after_forward!r}")
    mesh = resolve_mesh(mesh)
    device = mesh_device(mesh)

    params, names, locations = _collect_parameters(module)
    by_key: dict[tuple[torch.dtype, bool], list[int]] = {}
    for index, param in enumerate(params):
        by_key.setdefault((param.dtype, param.requires_grad), []).append(index)

    # Everything that can fail happens before the module is touched.
    groups: list[ParameterGroup] = []
    group_locations: list[list[list[_Location]]] = []
    for indices in by_key.values():
        groups.append(
            ParameterGroup([params[i] for i in indices], [names[i] for i in indices], mesh, mp_policy, device)
        )
        group_locations.append([locations[id(params[i])] for i in indices])

    state = _UnitState(module, mesh, mp_policy, reshard_after_forward, groups, group_locations)
    state._swap(unsharded=False)
    for group in groups:
        group.register()
    for param, name in zip(params, names):
        _CONSUMED[param] = f"parameter '{name}' of an already fully_shard-ed {type(module).__name__}"
    # Units are built bottom-up, each naming its parameters from itself; a parent prefixes its
    # children's names, so error messages name parameters from the outermost unit.
    for prefix, child in _fsdp_children(module):
        for group in parameter_groups(child):
            group.names = [prefix + name for name in group.names]
    for _, owner in _owned_modules(module):
        for name, buffer in owner._buffers.items():
            if buffer is not None and buffer.device != device:
                owner._buffers[name] = buffer.to(device)
    module._fsdp_state = state  # type: ignore[assignment]
    module.register_forward_pre_hook(state.pre_forward, with_kwargs=True)
    module.register_forward_hook(state.post_forward)
    module.__class__ = _fsdp_class(type(module))
    return module
