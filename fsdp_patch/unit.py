"""One FSDP unit's parameters through an iteration, and the state a root shares with its units.

A unit moves through the states of FSDP2's ``TrainingState``:

- ``IDLE`` -> ``FORWARD`` (pre-forward): all-gather the compute copy of each group and put the
  unsharded parameters into the module;
- ``FORWARD`` -> ``IDLE`` (post-forward): put the sharded parameters back; free the unsharded
  storage when ``reshard_after_forward`` (never during a backward: that forward is an
  activation-checkpointing recompute whose backward follows at once);
- ``IDLE`` -> ``PRE_BACKWARD`` (the first grad reaching the unit's outputs): all-gather again if
  freed and put the unsharded parameters into the module, so that a recompute inside the unit
  (``torch.utils.checkpoint`` within its forward) computes with them;
- ``PRE_BACKWARD`` -> ``IDLE`` (post-backward: the grads of the unit's inputs are computed, or
  the root's final callback at the end of backward): reduce-scatter the unsharded grads (or keep
  them while gradient sync is off), put the sharded parameters back, free the unsharded storage.

A forward that starts while its unit is ``PRE_BACKWARD`` is a recompute of a checkpoint placed
around the unit: its parameters are gathered and in place already, and its post-backward frees
them, so the forward hooks leave everything as it is (FSDP2 does the same).

Every backward pass (``backward`` any number of times per iteration, ``retain_graph`` or not)
reduces what it produced; ``torch.autograd.grad``, which fills no ``.grad``, reduces nothing.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from .mixed_precision import MixedPrecisionPolicy
from .output_tensors import grad_tensors
from .parameter_group import ParameterGroup

if TYPE_CHECKING:
    from .module import FSDPModule

__all__ = ["RootContext", "TrainingState", "UnitState"]

Location = tuple[nn.Module, str]
Replacement = tuple[ParameterGroup, int, Any]  # (group, index in the group, what stood there)


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class RootContext:
    """State shared by all units under one root for the current iteration."""

    def __init__(self, root: "UnitState", states: list["UnitState"]) -> None:
        self.root = root
        self.states = states
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

    def _final_callback(self) -> None:
        try:
            for state in reversed(self.states):
                state.finish_backward()
            for state in self.states:
                for group in state.groups:
                    group.finalize_grads()
        finally:
            self.callback_task = None

    def interrupted(self) -> bool:
        """Whether an exception aborted a forward or backward of this root's units.

        Only meaningful outside a backward pass.
        """
        return self.callback_task is not None or any(s.training_state is not TrainingState.IDLE for s in self.states)

    def reset(self) -> None:
        self.callback_task = None
        for state in self.states:
            state.reset()


class UnitState:
    """Per-unit state: groups, where their parameters live in the module tree, hook logic."""

    def __init__(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        policy: MixedPrecisionPolicy,
        reshard_after_forward: bool,
        groups: list[ParameterGroup],
        locations: list[list[list[Location]]],
    ) -> None:
        self.module = module
        self.mesh = mesh
        self.policy = policy
        self.reshard_after_forward = reshard_after_forward
        self.groups = groups
        self.locations = locations
        self.requires_gradient_sync = True
        self.context: RootContext | None = None
        self.training_state = TrainingState.IDLE
        # A grad-enabled forward whose outputs hold no tensor a pre-backward hook can go on: the
        # unit stays gathered and the final callback (queued by its parameters' grads) finishes it.
        self._awaiting_final: list[RemovableHandle] | None = None

    # ------------------------------------------------------------------ parameters in the module
    def swap(self, unsharded: bool, sync_requires_grad: bool = False) -> list[Replacement]:
        """Registers the unsharded (or sharded) parameters in the modules.

        With ``sync_requires_grad`` an unsharded parameter trains exactly when its sharded one
        does (``requires_grad_`` after ``fully_shard`` is honoured from the next forward on).

        Returns:
            What stood where a sharded parameter was expected when swapping the unsharded
            ones in: tensors that replaced sharded parameters (see :meth:`adopt`).
        """
        replaced: list[Replacement] = []
        for group, group_locations in zip(self.groups, self.locations):
            params = group.unsharded_params if unsharded else group.params
            for index, (param, places) in enumerate(zip(params, group_locations)):
                if sync_requires_grad:
                    wanted = group.params[index].requires_grad
                    if param.requires_grad is not wanted:
                        param.requires_grad_(wanted)
                for owner, name in places:
                    if unsharded and owner._parameters.get(name) is not group.params[index]:
                        replaced.append((group, index, owner._parameters.get(name)))
                    owner._parameters[name] = param
        return replaced

    def adopt_replaced_parameters(self) -> None:
        """:meth:`adopt` for whatever replaced sharded parameters in the modules now."""
        replaced: list[Replacement] = []
        for group, group_locations in zip(self.groups, self.locations):
            for index, (param, places) in enumerate(zip(group.params, group_locations)):
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

    # ------------------------------------------------------------------ gather / free
    def lazy_init_as_root(self) -> None:
        from .module import FSDPModule

        states = [m._fsdp_state for m in self.module.modules() if isinstance(m, FSDPModule)]
        context = RootContext(self, states)
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
        self.training_state = TrainingState.IDLE
        self._stop_awaiting_final()
        self.swap(unsharded=False)
        for group in self.groups:
            group.reset_iter_state()

    def abort_forward(self) -> None:
        """Undoes the pre-forward of a forward that raised (the post-forward never ran)."""
        if self.training_state is not TrainingState.FORWARD:
            return
        self.training_state = TrainingState.IDLE
        self.swap(unsharded=False)
        if not _in_backward():
            self.reshard()

    # ------------------------------------------------------------------ forward hooks
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.training_state is TrainingState.PRE_BACKWARD and _in_backward():
            return args, kwargs  # a recompute: see the module docstring
        if self.context is None:
            self.lazy_init_as_root()
        elif self.context.root is self and not _in_backward() and self.context.interrupted():
            self.context.reset()
        replaced = self.swap(unsharded=True, sync_requires_grad=True)
        if replaced:
            self.adopt(replaced)
        self.unshard()
        self.training_state = TrainingState.FORWARD
        if torch.is_grad_enabled():
            args, kwargs = _register_post_backward(self, args, kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self.training_state is TrainingState.PRE_BACKWARD and _in_backward():
            return output
        self.swap(unsharded=False)
        self.training_state = TrainingState.IDLE
        may_free = not _in_backward() and self._awaiting_final is None
        if not torch.is_grad_enabled():
            if may_free:
                self.reshard()
            return output
        tensors = grad_tensors(output)
        if tensors:
            register_multi_grad_hook(tensors, self._pre_backward, mode="any")
            if self.reshard_after_forward and may_free:
                self.reshard()
        elif any(group.requires_grad for group in self.groups):
            if self._awaiting_final is None:
                trainable = [p for g in self.groups for p in g.unsharded_params if p.requires_grad]
                self._awaiting_final = [p.register_post_accumulate_grad_hook(self._queue_final) for p in trainable]
        elif may_free:
            self.reshard()  # frozen, and no output needs a grad: no backward comes through here
        return output

    def _queue_final(self, param: torch.Tensor) -> None:
        assert self.context is not None
        self.context.queue_final_callback()

    def _stop_awaiting_final(self) -> None:
        if self._awaiting_final is not None:
            for handle in self._awaiting_final:
                handle.remove()
            self._awaiting_final = None

    # ------------------------------------------------------------------ backward hooks
    def _pre_backward(self, grad: torch.Tensor) -> None:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return
        assert self.context is not None
        self.context.queue_final_callback()
        self.unshard()
        self.swap(unsharded=True)
        self.training_state = TrainingState.PRE_BACKWARD

    def post_backward(self) -> None:
        """The unit's backward is done: reduce (or keep, with sync off) its grads, free it."""
        if self.training_state is not TrainingState.PRE_BACKWARD and self._awaiting_final is None:
            return
        self._stop_awaiting_final()
        if self.training_state is TrainingState.PRE_BACKWARD:
            self.swap(unsharded=False)
        for group in self.groups:
            group.post_backward(self.requires_gradient_sync)
        self.reshard()
        self.training_state = TrainingState.IDLE

    def finish_backward(self) -> None:
        """The root's final callback: the post-backward of units whose inputs needed no grad,
        and freeing units a forward gathered that this backward did not reach."""
        if self.training_state is TrainingState.PRE_BACKWARD or self._awaiting_final is not None:
            self.post_backward()
        elif self.training_state is TrainingState.IDLE:
            self.reshard()


class _RegisterPostBackward(torch.autograd.Function):
    """Identity on the unit's inputs whose backward marks the end of the unit's backward."""

    @staticmethod
    def forward(ctx: Any, state: UnitState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.state.post_backward()
        return (None, *grads)


def _register_post_backward(state: UnitState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # Positional tensors only (most forwards): no pytree round trip on the hot path.
    plain = not kwargs and all(isinstance(a, torch.Tensor) for a in args)
    flat, spec = (list(args), None) if plain else tree_flatten((args, kwargs))
    indices = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not indices:
        return args, kwargs
    outputs = _RegisterPostBackward.apply(state, *(flat[i] for i in indices))
    for i, out in zip(indices, outputs):
        flat[i] = out
    return (tuple(flat), kwargs) if spec is None else tree_unflatten(flat, spec)
