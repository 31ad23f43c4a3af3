"""One FSDP unit's parameters through an iteration: the states it moves through and the hooks that move it.

A unit moves through the states of FSDP2's ``TrainingState``:

- ``IDLE`` -> ``FORWARD`` (pre-forward): all-gather the compute copy of each group and put the
  unsharded parameters into the module;
- ``FORWARD`` -> ``IDLE`` (post-forward): with ``reshard_after_forward``, put the sharded
  parameters back and free the unsharded storage (never during a backward: that forward is an
  activation-checkpointing recompute whose backward follows at once); without it (the root's
  default, as FSDP2's), keep the unsharded parameters in the module until the post-backward, so
  that code after forward can use them (a penalty on a weight, logits tied to the embedding);
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
What a root shares with its units over an iteration (the order units are entered in, the final
callback, the reduce-scatters in flight) is :class:`~.root_context.RootContext`.
Which parameters the modules hold, and the tensors that replaced sharded ones there, is
:class:`~.parameter_placement.ParameterPlacement`.

Alternatives considered:
    - Counting ``post_accumulate_grad`` hooks to detect the end of a unit's backward: breaks
      when a weight is used more than once; the input-side autograd function
      (:class:`_RegisterPostBackward`) does not.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.hooks import RemovableHandle

from ..mixed_precision import MixedPrecisionPolicy
from ..sharding import ParameterGroup
from .compile_boundary import outside_dynamo
from .output_tensors import grad_tensors
from .parameter_placement import Location, ParameterPlacement, Replacement
from .root_context import RootContext
from .training_state import TrainingState

__all__ = ["UnitState"]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class UnitState:
    """Per-unit state: groups, where their parameters live in the module tree, hook logic."""

    def __init__(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        policy: MixedPrecisionPolicy,
        reshard_after_forward: bool | None,
        groups: list[ParameterGroup],
        locations: list[list[list[Location]]],
    ) -> None:
        self.module = module
        # Every module of the unit: one, or those fully_shard([a, b, ...]) grouped (their
        # parameters gathered and reduced together); see group_pre_forward.
        self.modules: list[nn.Module] = [module]
        self._to_run: set[int] = set()  # a grouped unit's modules not yet run in this forward
        # Post-backwards registered on the inputs of forwards whose backward has not reached them
        # yet: a unit called several times (per chunk of a loss, or once more on its own output)
        # stays gathered until the backward of its last call is done, as its weights are needed.
        self._pending_backwards = 0
        self.mesh = mesh
        self.policy = policy
        # None: decided by the unit's place, as FSDP2 decides it: the root of the forward keeps
        # its parameters unsharded after forward (its backward comes first and needs them at
        # once), every other unit reshards.
        self.reshard_after_forward_setting = reshard_after_forward
        self.reshard_after_forward = True if reshard_after_forward is None else reshard_after_forward
        self.groups = groups
        self.locations = locations
        # Which parameters the modules hold: the unsharded ones inside forward and backward, and
        # between them for a unit that keeps them after forward.
        self.placement = ParameterPlacement(groups, locations)
        self.requires_gradient_sync = True
        self.context: RootContext | None = None
        self.training_state = TrainingState.IDLE
        # A grad-enabled forward whose outputs hold no tensor a pre-backward hook can go on: the
        # unit stays gathered and the final callback (queued by its parameters' grads) finishes it.
        self._awaiting_final: list[RemovableHandle] | None = None
        # Overlap: how many units this one gathers ahead in forward and in backward (their
        # all-gathers run while this unit computes), or explicit lists of units, as FSDP2's
        # set_modules_to_forward_prefetch / set_modules_to_backward_prefetch; and the
        # reduce-scatters left in flight while backward goes on.
        self.prefetch_depth = {1: 1, -1: 1}
        self.explicit_prefetch: dict[int, list[UnitState] | None] = {1: None, -1: None}
        self.reduces_in_flight = 1  # FSDP2's default reduce_scatter_max_input_buffers
        self.prefetched = False  # gathered ahead and not yet entered
        # FSDP2's set_reshard_after_backward: False keeps the unsharded storage after a backward
        # without gradient sync, for the next microbatch's forward (see post_backward).
        self.reshard_after_backward = True
        # FSDP2's set_unshard_in_backward: False when backward needs none of the unit's values.
        self.unshard_in_backward = True
        # FSDP2's set_requires_all_reduce: HSDP's all-reduce skipped while False.
        self.requires_all_reduce = True
        # FSDP2's set_post_optim_event: what the root's next forward waits for, once.
        self.post_optim_event: Any = None

    # ------------------------------------------------------------------ parameters in the module
    def swap(self, unsharded: bool, sync_requires_grad: bool = False) -> list[Replacement]:
        """Registers the unsharded (or sharded) parameters in the modules (see
        :meth:`.ParameterPlacement.swap`)."""
        return self.placement.swap(unsharded, sync_requires_grad)

    def release_kept_parameters(self) -> None:
        """Puts the sharded parameters back into the modules of a unit that kept its unsharded
        ones after forward (the storage stays for the backward, which swaps them in again).

        Before ``state_dict``, ``load_state_dict`` and ``zero_grad``, which must reach the
        sharded parameters (FSDP2 reshards before saving and loading likewise)."""
        if self.placement.unsharded and self.training_state is TrainingState.IDLE:
            self.swap(unsharded=False)

    # ------------------------------------------------------------------ gather / free
    def lazy_init_as_root(self) -> None:
        # The units under this root: the modules fully_shard gave a state.
        found = (getattr(m, "_fsdp_state", None) for top in self.modules for m in top.modules())
        # A grouped unit is found under each of its modules: once.
        states = list({id(state): state for state in found if isinstance(state, UnitState)}.values())
        context = RootContext(self, states)
        for state in states:
            state.context = context
            if state.reshard_after_forward_setting is None:
                state.reshard_after_forward = state is not self

    def unshard(self) -> None:
        for group in self.groups:
            group.unshard()

    def reshard(self) -> None:
        self.prefetched = False
        for group in self.groups:
            group.reshard()

    def reshard_by_hand(self) -> None:
        """``FSDPModule.reshard``: the sharded parameters back into the modules (of a unit that
        kept its unsharded ones after forward) and the unsharded storage freed."""
        if self.training_state is TrainingState.IDLE and self.placement.unsharded:
            self.swap(unsharded=False)
        self.reshard()

    def reset(self) -> None:
        """Forgets an iteration an exception aborted: sharded params back in the module,
        unsharded storage and grads dropped, grads the aborted backward had partly reduced
        discarded (see :meth:`ParameterGroup.reset_iter_state`)."""
        self.training_state = TrainingState.IDLE
        self.prefetched = False
        self._pending_backwards = 0
        self._stop_awaiting_final()
        self.swap(unsharded=False)
        for group in self.groups:
            group.reset_iter_state()

    @outside_dynamo
    def abort_forward(self) -> None:
        """Undoes the pre-forward of a forward that raised (the post-forward never ran)."""
        if self.training_state is not TrainingState.FORWARD:
            return
        self.training_state = TrainingState.IDLE
        self.swap(unsharded=False)
        if not _in_backward():
            self.reshard()
            if self.context is not None:
                self.context.cancel_prefetches()

    # ------------------------------------------------------------------ forward hooks
    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The policy's ``cast_forward_inputs``: floating-point tensors to the compute dtype."""
        dtype = self.policy.param_dtype
        if dtype is None or not self.policy.cast_forward_inputs:
            return args, kwargs
        return tree_map(functools.partial(_cast_float, dtype), (args, kwargs))

    def _cast_output(self, output: Any) -> Any:
        dtype = self.policy.output_dtype
        return output if dtype is None else tree_map(functools.partial(_cast_float, dtype), output)

    @outside_dynamo
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs = self._cast_inputs(args, kwargs)
        if self.training_state is TrainingState.PRE_BACKWARD and _in_backward():
            return args, kwargs  # a recompute: see the module docstring
        if self.context is None:
            self.lazy_init_as_root()
        context = self.context
        assert context is not None
        recompute = _in_backward()
        if context.root is self and not recompute:
            if context.interrupted():
                context.reset()
            context.begin_forward()
            if self.post_optim_event is not None:
                event, self.post_optim_event = self.post_optim_event, None
                event.wait()
        if not recompute and (context.root is self or not context.in_forward):
            # Anything may have written the main weights since the last forward, unseen: the
            # compute copies are cast again at their first all-gather of this iteration (and of
            # a unit called on its own); see ParameterGroup's freshness note.
            for state in context.states if context.root is self else (self,):
                for group in state.groups:
                    group.invalidate_compute_copy()
        replaced = self.swap(unsharded=True, sync_requires_grad=True)
        if replaced:
            self.placement.adopt(replaced)
        self.prefetched = False
        self.unshard()
        self.training_state = TrainingState.FORWARD
        if not recompute:
            context.entered_forward(self)
            self._prefetch(1)
        if torch.is_grad_enabled():
            args, kwargs, registered = _register_post_backward(self, args, kwargs)
            self._pending_backwards += registered
        return args, kwargs

    @outside_dynamo
    def group_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Pre-forward of one module of a grouped unit (``fully_shard([a, b])``): the first of its
        modules to run in a forward does the unit's pre-forward (gather, and the post-backward
        on its inputs, whose grads come last); the others, whose parameters are in place by
        then, cast their inputs only (FSDP2's grouped hooks)."""
        if self.training_state is TrainingState.FORWARD:
            return self._cast_inputs(args, kwargs)
        self._to_run = {id(m) for m in self.modules}
        return self.pre_forward(module, args, kwargs)

    @outside_dynamo
    def group_post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """Post-forward of one module of a grouped unit: the unit's post-forward once its last
        module ran within the root's forward, or at once for a call of its own (a module called
        per chunk after the root's forward); otherwise the output cast only."""
        if self.training_state is not TrainingState.FORWARD:
            return self.post_forward(module, args, output)
        self._to_run.discard(id(module))
        context = self.context
        inside_root = context is not None and context.root is not self and context.in_forward
        if self._to_run and inside_root:
            return self._cast_output(output)
        self._to_run = set()
        return self.post_forward(module, args, output)

    def complete_forward(self) -> None:
        """Ends the forward of a grouped unit whose modules did not all run in the root's
        forward (the root's post-forward calls it, as FSDP2 completes such groups there): its
        parameters stay gathered until the end of backward, which finishes it."""
        self._to_run = set()
        self._post_forward(None)

    @outside_dynamo
    def post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        # The pre-backward hook goes on the output as computed; its cast (the policy's
        # output_dtype) comes after, as FSDP2's, so that its grad reaches the hook.
        return self._cast_output(self._post_forward(output))

    def _post_forward(self, output: Any) -> Any:
        if self.training_state is TrainingState.PRE_BACKWARD and _in_backward():
            return output
        in_backward = _in_backward()
        grad_enabled = torch.is_grad_enabled()
        if self.reshard_after_forward or not grad_enabled or in_backward:
            self.swap(unsharded=False)
        self.training_state = TrainingState.IDLE
        if self.context is not None and self.context.root is self and not in_backward:
            for state in self.context.states:
                if state is not self and state.training_state is TrainingState.FORWARD and state._to_run:
                    state.complete_forward()
            self.context.end_forward()
        may_free = not in_backward and self._awaiting_final is None
        if not grad_enabled:
            if may_free:
                self.reshard()
            return output
        tensors = grad_tensors(output)
        if tensors:
            register_multi_grad_hook(tensors, self._pre_backward, mode="any")
            if self.reshard_after_forward and may_free:
                # reshard_after_forward=<int> keeps a part (ParameterGroup.reshard_after_forward).
                self.prefetched = False
                for group in self.groups:
                    group.reshard_after_forward()
        elif any(group.requires_grad for group in self.groups):
            if self._awaiting_final is None:
                trainable = [p for g in self.groups for p in g.unsharded_params if p.requires_grad]
                self._awaiting_final = [p.register_post_accumulate_grad_hook(self._queue_final) for p in trainable]
        elif may_free:
            # Frozen, and no output needs a grad: no backward comes through here.
            self.swap(unsharded=False)
            self.reshard()
        return output

    @outside_dynamo
    def _queue_final(self, param: torch.Tensor) -> None:
        assert self.context is not None
        self.context.queue_final_callback()

    def _stop_awaiting_final(self) -> None:
        if self._awaiting_final is not None:
            for handle in self._awaiting_final:
                handle.remove()
            self._awaiting_final = None

    # ------------------------------------------------------------------ backward hooks
    @outside_dynamo
    def _pre_backward(self, grad: torch.Tensor) -> None:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return
        assert self.context is not None
        self.context.queue_final_callback()
        self.prefetched = False
        if self.unshard_in_backward:
            self.unshard()
        self.swap(unsharded=True)
        self.training_state = TrainingState.PRE_BACKWARD
        self._prefetch(-1)

    def _prefetch(self, direction: int) -> None:
        """Starts the all-gathers of the units that come next (forward: 1, backward: -1)."""
        assert self.context is not None
        targets = self.explicit_prefetch[direction]
        if targets is None:
            targets = self.context.neighbours(self, direction, self.prefetch_depth[direction])
        for target in targets:
            if target.training_state is TrainingState.IDLE and not any(g.is_unsharded for g in target.groups):
                for group in target.groups:
                    group.start_unshard()
                target.prefetched = True

    @outside_dynamo
    def post_backward(self, final: bool = False) -> None:
        """The backward of one call of the unit is done: once it is the last call's (or at the
        end of backward, ``final``), reduce (or keep, with sync off) its grads and free it."""
        if self.training_state is not TrainingState.PRE_BACKWARD and self._awaiting_final is None:
            return
        if self._pending_backwards > 1 and not final:
            self._pending_backwards -= 1
            return
        self._pending_backwards = 0
        self._stop_awaiting_final()
        if self.placement.unsharded:
            self.swap(unsharded=False)
        # Kept only across microbatches without sync: after a synced backward the optimizer
        # step changes the weights the kept storage holds, which the next forward would use
        # (FSDP2 keeps it there too, and computes with the weights from before the step).
        # Freed before the grads are packed for the reduce, as FSDP2 does: the unsharded
        # weights and the packed grads are then never held at once.
        if self.reshard_after_backward or self.requires_gradient_sync:
            self.reshard()
        if self.context is not None and self.requires_gradient_sync:
            self.context.make_room(self.reduces_in_flight)
        for group in self.groups:
            group.post_backward(self.requires_gradient_sync, self.requires_all_reduce)
        if self.context is not None:
            self.context.reducing(self.groups, self.reduces_in_flight)
        self.training_state = TrainingState.IDLE

    def finish_backward(self) -> None:
        """The root's final callback: the post-backward of units whose inputs needed no grad,
        and freeing units a forward gathered that this backward did not reach."""
        if self.training_state is TrainingState.PRE_BACKWARD or self._awaiting_final is not None:
            self.post_backward(final=True)
        elif self.training_state is TrainingState.IDLE:
            if self.placement.unsharded:
                self.swap(unsharded=False)  # kept after a forward this backward did not reach
            if self.reshard_after_backward or self.requires_gradient_sync:
                self.reshard()


def _cast_float(dtype: torch.dtype, x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x


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


def _register_post_backward(state: UnitState, args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
    # Positional tensors only (most forwards): no pytree round trip on the hot path.
    plain = not kwargs and all(isinstance(a, torch.Tensor) for a in args)
    flat, spec = (list(args), None) if plain else tree_flatten((args, kwargs))
    indices = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not indices:
        return args, kwargs, False
    outputs = _RegisterPostBackward.apply(state, *(flat[i] for i in indices))
    for i, out in zip(indices, outputs, strict=True):
        flat[i] = out
    args, kwargs = (tuple(flat), kwargs) if spec is None else tree_unflatten(flat, spec)
    return args, kwargs, True
