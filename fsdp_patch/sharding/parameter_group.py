"""Parameter groups: the policy composing the sharding layers for a set of same-dtype parameters.

The group is only the policy: each method decides when, and hands the work to a layer below,
the modules beside this one. Its two moving parts are layers of their own, which it drives:
:attr:`ParameterGroup.unsharding` (:mod:`.unsharding`: the all-gathers into the unsharded
parameters and their freeing) and :attr:`ParameterGroup.grad_reduce` (:mod:`.grad_reduce`: the
reduce-scatters and HSDP's all-reduces of their grads into ``main_grad``).

A group owns, for this rank, three sharded flat buffers in one layout and decides when each is
written: ``main_weight`` (``main_params_dtype``), which the optimizer updates through the
group's DTensor ``Shard(0)`` parameters (views into it); ``compute_weight``, the compute-dtype
copy forward and backward all-gather (see :mod:`.compute_copy` for its two lifetimes; the main
weights themselves when the dtypes agree; torchao's float8 weights in float8 with their scales,
:mod:`.float8_copy`); ``main_grad`` (``main_grads_dtype``), which backward
reduce-scatters into and whose views become the parameters' ``.grad`` (ownership and presence:
:mod:`.main_grads`). Collectives are :mod:`.collectives` handles; the unsharded parameters are
views of an :class:`~.flat_buffer.UnshardedBuffer`. Whether a parameter trains is read from its
sharded parameter's ``requires_grad`` at every forward. Every cast, refresh and zeroing is one
operation on a whole buffer, never one per tensor.

[Note: compute-copy freshness]
Anything may write the main weights in place: the optimizer adapter, an optimizer that is not
adapted (``foreach`` or not), ``p.data.mul_()``, ``torch._foreach_lerp_`` (EMA), clamping,
``nn.init`` on the sharded parameters, ``state_dict()[k].copy_()``, ``load_state_dict``,
``dcp.load``. Most of these run below autograd (DTensor runs the local op there; ``.data`` has a
version counter of its own), so no version counter sees them, and freshness does not rest on
one: each root forward (and an explicit ``unshard``) invalidates the compute copy
(:meth:`ParameterGroup.invalidate_compute_copy`), and the group's next all-gather casts it
again. A refresh is counted (by :class:`~.compute_copy.ComputeCopy`) and every gather carries the
count it was issued at (:class:`~.unsharding.Unsharding`), so a gather made before a refresh (an explicit ``unshard`` before an optimizer step) is never taken for
current; one made since the last refresh is used as gathered, as FSDP2 uses it.

Alternatives considered:
    - One class holding the buffers, the collectives, main-grad ownership and the policy: eight
      concerns sharing about twenty mutable fields, where changing one breaks another.
    - Summing version counters once per iteration: misses every write made below autograd, and
      forward would run on old weights.
    - Casting at every all-gather for both lifetimes: ``per_gather`` does; the persistent copy
      is cast once per iteration and backward's re-gather reads it without a cast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from ..mixed_precision import MixedPrecisionPolicy
from ..torch_interop.profiling import labelled
from .all_gather_extension import Float8Weight
from .compute_copy import ComputeCopy
from .dtensors import ShardSpecs
from .flat_buffer import ShardedBuffer, UnshardedBuffer
from .float8_copy import Float8ComputeCopy
from .grad_reduce import GradReduce, ReduceHook
from .layout import GroupLayout
from .main_grads import MainGrads
from .placement import MeshDims
from .replacement import adopted_shard, check_replacement
from .tensor_parallel import TensorParallel
from .unsharding import Unsharding

__all__ = ["ParameterGroup"]


class ParameterGroup:
    """Sharded parameters of one compute dtype and their flat buffers.

    Args:
        params: Original (unsharded) parameters, all of one compute dtype (their own dtype, or
            the policy's ``param_dtype``); those on the meta device
            give zero shards, to be initialized after sharding. ``fully_shard`` also splits
            groups by ``requires_grad`` at sharding time, so that a group frozen then holds no
            main-grad buffer; toggling ``requires_grad`` later works per parameter.
        names: Their fully qualified names, for error messages.
        mesh: Device mesh to shard over: 1-D, or 2-D for HSDP (see :class:`~.placement.MeshDims`).
        policy: Mixed-precision policy.
        device: Device holding this rank's shards.
        tensor_parallel: Per parameter, how tensor parallelism placed it, or ``None`` (all
            plain): such a parameter's TP-local tensor is what the group shards (see
            :mod:`.tensor_parallel`).
        float8: torchao's float8 weights (every parameter one of the kind given): the compute
            copy is kept and gathered in float8 (:mod:`.float8_copy`), the unsharded parameters
            are ``Float8TrainingTensor`` s; ``None``: a copy in the compute dtype.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        mesh: DeviceMesh,
        policy: MixedPrecisionPolicy,
        device: torch.device,
        tensor_parallel: Sequence[TensorParallel | None] | None = None,
        float8: Float8Weight | None = None,
    ) -> None:
        self.names = list(names)
        self.float8 = float8
        self.tensor_parallel: tuple[TensorParallel | None, ...] = tuple(tensor_parallel or (None,) * len(params))
        # What the group shards: each parameter's TP-local tensor, or the parameter itself.
        data = [p._local_tensor if isinstance(p, DTensor) else p for p in params]
        self.mesh = mesh
        self.dims = MeshDims.of(mesh)
        # Sharding and its collectives run over the shard dimension; HSDP's replicas (the
        # other dimension) all-reduce the reduce-scattered grads (see wait_reduce).
        self.process_group = self.dims.shard_group
        self.world_size = self.dims.shard_size
        self.rank = self.dims.shard_rank
        self.compute_dtype = policy.compute_dtype_for(params[0].dtype)
        self.main_dtype = policy.main_params_dtype
        self.grads_dtype = policy.grads_dtype_for(self.compute_dtype)
        self.compute_copy = policy.compute_copy
        self._device = device
        self.layout = GroupLayout.build([d.shape for d in data], self.world_size, self.rank)
        self._specs = ShardSpecs(mesh, self.layout.params, self.dims.placements, self.tensor_parallel)

        self._main = ShardedBuffer.allocate(self.layout, self._specs, self.main_dtype, device, zeroed=True)
        with torch.no_grad():
            for index, tensor in enumerate(data):
                if not tensor.is_meta:  # a meta-built model is initialized after fully_shard
                    self._main.local(index).copy_(tensor.detach()[self.layout.params[index].local_rows_slice])
        self._copy = (
            ComputeCopy(self._main, self.compute_dtype, self.compute_copy)
            if float8 is None
            else Float8ComputeCopy(self._main, float8, self.compute_dtype, self.process_group)
        )
        self.params: list[nn.Parameter] = [
            self._main.dtensor(index, requires_grad=param.requires_grad)  # type: ignore[misc]
            for index, param in enumerate(params)
        ]
        for param in self.params:
            param._is_param = True
            param.grad_dtype = self.grads_dtype
        self._index_of = {id(param): index for index, param in enumerate(self.params)}
        self._grads = MainGrads(self.layout, self._specs, self.grads_dtype, device)

        unsharded = UnshardedBuffer(
            self.layout,
            self._copy.buffer.dtype,
            device,
            [p.requires_grad for p in params],
            self.tensor_parallel,
            self._copy.unsharded_data,
        )
        self.unsharded_params = unsharded.params
        # The layers below that this policy drives: the gathers into the unsharded parameters,
        # the reduces of their grads into main_grad (each with FSDP2's communication settings).
        self.unsharding = Unsharding(unsharded, self._copy, self.layout, self.dims, device)
        self.grad_reduce = GradReduce(
            self, self._grads, self.params, self.unsharded_params, self.layout, self.dims, self.compute_dtype
        )

    # ------------------------------------------------------------------ identity and buffers
    @property
    def main_weight(self) -> torch.Tensor:
        return self._main.tensor

    @property
    def compute_weight(self) -> torch.Tensor:
        return self._copy.buffer.tensor

    @property
    def main_grad(self) -> torch.Tensor | None:
        """The flat sharded main-grad buffer, or ``None`` while no grad of the group holds it."""
        return self._grads.buffer

    def main_grad_storage_bytes(self) -> int:
        return self._grads.storage_bytes()

    @property
    def requires_grad(self) -> bool:
        """Whether any parameter of the group trains (its sharded parameter requires grad)."""
        return any(param.requires_grad for param in self.params)

    @property
    def tensor_parallel_split(self) -> list[bool]:
        """Per parameter, whether tensor parallelism splits it (each TP rank holds other elements)
        rather than copying it on every TP rank (a plain or ``Replicate`` parameter)."""
        return [tp is not None and tp.splits for tp in self.tensor_parallel]

    @property
    def replicate_group(self) -> Any:
        """HSDP's group of this rank's replicas (ranks that hold the same shard), or ``None``."""
        return self.dims.replicate_group

    @property
    def tensor_parallel_group(self) -> Any:
        """The process group of the TP mesh of the group's parameters that tensor parallelism
        placed (``None``: none did)."""
        return next((tp.spec.mesh.get_group() for tp in self.tensor_parallel if tp is not None), None)

    def index_of(self, param: torch.Tensor) -> int:
        """Position of one of this group's sharded parameters in :attr:`params`."""
        return self._index_of[id(param)]

    def dtensor_specs(self, dtype: torch.dtype) -> list[Any]:
        """One ``DTensorSpec`` per parameter for a shard of ``dtype`` (cached): to build
        DTensor views of a flat buffer laid out as the group's (see :attr:`layout`)."""
        return self._specs.specs(dtype)

    def state_dict_tensor(self, index: int) -> DTensor:
        """``params[index]``'s entry in a state dict: a DTensor over the same memory, so that a
        write into it (``dcp.load`` into ``get_model_state_dict``'s tensors) is a write to the
        main weights."""
        return self._main.dtensor(index)

    # ------------------------------------------------------------------ the compute copy
    @property
    def compute_aliases_main(self) -> bool:
        return self._copy.aliases_main

    @property
    def compute_per_gather(self) -> bool:
        """Whether no compute copy is kept, each all-gather casting the main weights itself
        (``compute_copy="per_gather"``, compute dtype not the main dtype): the optimizer
        adapter then marks the weights changed instead of refreshing, and precision
        diagnostics derive the compute weights by the same cast."""
        return self._copy.per_gather

    def compute_storage_bytes(self) -> int:
        """Bytes the compute copy holds now (0 when it is the main weight, or released)."""
        return self._copy.storage_bytes

    @property
    def compute_stale(self) -> bool:
        """Whether the compute copy lags the main weights: the next gather refreshes it first."""
        return self._copy.stale

    def mark_weights_changed(self) -> None:
        """Notes a write to the main weights: the next gather casts the compute copy again."""
        self._copy.weights_changed()

    def invalidate_compute_copy(self) -> None:
        """Marks the compute copy stale unless the unsharded parameters hold (or are gathering)
        weights cast since the last refresh (see the freshness note): run at each root forward
        and explicit ``unshard``, before any all-gather of the iteration is issued."""
        if not self.unsharding.holds_current_gather():
            self._copy.invalidate()

    @labelled("cast_compute_weight")
    def refresh_compute_weight(self, after_step: bool = False) -> int:
        """Refreshes the compute copy from the main weights (one cast for the group; a
        ``per_gather`` group only counts the refresh, so that gathers made before it are redone).
        ``after_step``: the optimizer adapter's refresh after a step, not a gather's.

        Returns:
            Bytes written by the cast (0 when the compute copy is the main weight, or none is kept).
        """
        return self._copy.refresh(after_step)

    # ------------------------------------------------------------------ tensors that replaced parameters
    def check_replacement(self, index: int, replacement: object) -> None:
        """Raises if ``replacement`` cannot stand in for ``params[index]`` (see
        :func:`~.replacement.check_replacement`)."""
        check_replacement(
            self.names[index], self.layout.params[index], cast(DTensor, self.params[index]), replacement, self.float8
        )

    def adopt(self, index: int, replacement: torch.Tensor) -> None:
        """Copies the values of a tensor that replaced ``params[index]`` in its module into the
        main weights (see :func:`~.replacement.adopted_shard`); ``requires_grad`` follows the
        replacement. Call :meth:`check_replacement` first."""
        with torch.no_grad():
            self._main.local(index).copy_(
                adopted_shard(
                    self.layout.params[index],
                    cast(DTensor, self.params[index]),
                    self.tensor_parallel[index],
                    replacement,
                )
            )
        self._copy.weights_changed()
        self.params[index].requires_grad_(replacement.requires_grad)

    # ------------------------------------------------------------------ unsharded parameters
    @property
    def is_unsharded(self) -> bool:
        """Whether the unsharded parameters hold the gathered weights (or a gather is in flight)."""
        return self.unsharding.is_unsharded

    @property
    def gather_in_flight(self) -> bool:
        return self.unsharding.gather_in_flight

    def unshard(self) -> None:
        """All-gathers the compute copy into the unsharded parameters."""
        self.start_unshard()
        self.wait_unshard()

    @labelled("all_gather")
    def start_unshard(self) -> None:
        """Issues the all-gather without waiting for it (a prefetch), the compute copy refreshed
        first where it is stale; :meth:`wait_unshard` completes it. A no-op when the current
        weights are gathered or in flight."""
        if self._copy.stale:
            self.refresh_compute_weight()
        self.unsharding.start()

    def wait_unshard(self) -> None:
        """Completes an all-gather :meth:`start_unshard` issued: waits for it and copies the
        ranks' slots out into the unsharded parameters."""
        self.unsharding.wait()

    def reshard_after_forward(self) -> None:
        """Frees the unsharded parameters after forward: all of them, or with a post-forward
        group, all but the part this rank keeps for backward's re-gather (see
        [Note: resharding to a smaller group after forward] in :mod:`.unsharding`)."""
        self.unsharding.reshard_after_forward()

    def reshard(self) -> None:
        """Frees the unsharded parameters' storage (after an all-gather in flight completes)
        and the rows kept after forward."""
        self.unsharding.reshard()

    def unsharded_storage_bytes(self) -> int:
        """Bytes held for the unsharded state: the unsharded parameters' storage and the output
        of an all-gather in flight (whose copy-out allocates the former)."""
        return self.unsharding.storage_bytes()

    # ------------------------------------------------------------------ grads
    def post_backward(self, sync: bool, all_reduce: bool = True) -> None:
        """Reduce-scatters the unsharded grads into ``main_grad`` (``sync``), or keeps them for
        the next synced backward; a no-op when backward produced no grads for this group.

        HSDP: the reduce-scattered grads are then all-reduced over the replicas (at
        :meth:`wait_reduce`); with ``all_reduce`` off they are held instead, ``main_grad`` and
        the grads left as they are, and the next backward that all-reduces adds them in
        (FSDP2's ``set_requires_all_reduce(False)``).

        Skipping when there are no grads leaves ``torch.autograd.grad`` (which fills no
        ``.grad``) alone; within a group, a parameter without a grad contributes zeros (and a
        presence flag of 0), so every rank takes part in the same collectives whatever its
        control flow inside the group.
        """
        self.grad_reduce.post_backward(sync, all_reduce)

    @property
    def reduce_in_flight(self) -> bool:
        return self.grad_reduce.in_flight

    def advance_reduce(self) -> None:
        """Moves the reduces :meth:`post_backward` issued on (see :meth:`.GradReduce.advance`):
        under HSDP their all-reduces then overlap the rest of backward."""
        self.grad_reduce.advance()

    def wait_reduce(self) -> None:
        """Completes the reduce-scatters :meth:`post_backward` issued (and HSDP's all-reduces),
        in order, into ``main_grad``."""
        self.grad_reduce.wait()

    def register_reduce_hook(self, hook: ReduceHook) -> RemovableHandle:
        """Runs ``hook(group, stage, grads)`` around each reduce-scatter of the group's grads (see
        :meth:`.GradReduce.register_hook`)."""
        return self.grad_reduce.register_hook(hook)

    def finalize_grads(self) -> None:
        """Completes the reduce-scatters in flight, installs DTensor views of ``main_grad`` as
        the ``.grad`` of the trainable sharded parameters that have a grad (see
        :class:`~.main_grads.MainGrads`; a frozen one keeps what it has), then runs the
        post-accumulate-grad hooks registered on the sharded parameters whose grad the backward
        changed, once each, as FSDP2 runs them after its reduce (an optimizer step inside
        backward)."""
        self.grad_reduce.finalize()

    def install_zero_grads(self) -> None:
        """Gives trainable parameters without a grad a zeroed main-grad view as ``.grad``."""
        if not self.requires_grad:
            return
        self._grads.before_write()
        self._grads.install_zeros(self.params)

    def reset_iter_state(self) -> None:
        """Forgets an iteration an exception aborted (see ``FSDPModule.reset_iter_state``).

        Frees the unsharded storage and drops the unsharded grads (including those accumulated
        with gradient sync off). If the aborted backward had already reduced into
        ``main_grad``, the buffer no longer holds what the parameters' ``.grad`` held before,
        so their grads become ``None``: the next backward then overwrites the buffer.
        """
        self.grad_reduce.reset()
        self.reshard()

    # ------------------------------------------------------------------ lending grads
    def register_grad_write_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """Runs ``hook()`` before the group next writes its parameters' grads (see
        :meth:`~.main_grads.MainGrads.register_write_hook`): at the start of a backward's
        accumulation, in :meth:`install_zero_grads` and :meth:`reset_iter_state`."""
        return self._grads.register_write_hook(hook)

    @property
    def grad_write_hooks(self) -> tuple[Callable[[], None], ...]:
        return self._grads.write_hooks

    def grad_views(self, indices: Sequence[int]) -> list[DTensor | None]:
        """The live main-grad views of ``params[i]`` for ``i`` in ``indices`` (``None`` where
        none lives): what those parameters' ``.grad`` are when nobody replaced them."""
        return self._grads.views(indices)

    def adopt_foreign_grads(self, indices: Sequence[int]) -> torch.Tensor:
        """Makes ``params[i].grad``, for ``i`` in ``indices`` whose grad is not ``None``, views
        of ``main_grad`` holding their values (copying tensors a user assigned); returns
        ``main_grad``."""
        return self._grads.adopt_foreign(self.params, indices)

    def __repr__(self) -> str:
        return (
            f"ParameterGroup(params={len(self.params)}, compute={self.compute_dtype}, "
            f"main={self.main_dtype}, grads={self.grads_dtype}, shard_numel={self.layout.shard_numel})"
        )
