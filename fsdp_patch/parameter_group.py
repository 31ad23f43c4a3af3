"""Parameter groups: the flat buffers behind a set of same-dtype sharded parameters.

A group owns, for this rank, three flat buffers in one layout (see :mod:`.layout`):

- ``main_weight``: the sharded main weights (``main_params_dtype``), which the optimizer
  updates through the group's DTensor ``Shard(0)`` parameters, whose local tensors are views
  into this buffer;
- ``compute_weight``: a persistent sharded copy in the compute dtype, all-gathered by forward
  and backward without a cast, refreshed from the main weights once per optimizer step (the
  same tensor as ``main_weight`` when the two dtypes agree);
- ``main_grad``: the sharded main gradients (``main_grads_dtype``), which backward
  reduce-scatters into and whose DTensor views become the parameters' ``.grad``; ``None`` for a
  frozen group.

Every cast, refresh and zeroing is one operation on a whole buffer, never one per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from .dtensor_views import ShardSpecs
from .layout import GroupLayout
from .mixed_precision import MixedPrecisionPolicy

__all__ = ["ParameterGroup", "parameter_group_of", "contained_in_parameter_group"]

# Sharded parameter -> its group. A registry rather than an attribute on the parameter, so
# that copies of a parameter (deepcopy, pickling of an optimizer) are not mistaken for
# FSDP-managed ones and do not drag the group's buffers along.
_GROUP_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()

GradPresence = Literal["none", "all", "partial"]


def parameter_group_of(parameter: torch.Tensor) -> "ParameterGroup | None":
    """The group that manages ``parameter``, or ``None`` for a parameter FSDP does not own."""
    return _GROUP_OF.get(parameter)


def contained_in_parameter_group(parameter: torch.Tensor) -> bool:
    """Whether ``parameter`` is a sharded parameter managed by ``fully_shard``."""
    return parameter in _GROUP_OF


class ParameterGroup:
    """Sharded parameters of one (dtype, requires_grad) group and their flat buffers.

    Args:
        params: Original (unsharded) parameters, all of one dtype and ``requires_grad``.
        names: Their fully qualified names, for error messages.
        mesh: 1-D device mesh to shard over.
        policy: Mixed-precision policy.
        device: Device holding this rank's shards.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        mesh: DeviceMesh,
        policy: MixedPrecisionPolicy,
        device: torch.device,
    ) -> None:
        self.names = list(names)
        self.mesh = mesh
        self.process_group = mesh.get_group()
        self.world_size = mesh.size()
        self.rank = mesh.get_local_rank()
        self.compute_dtype = params[0].dtype
        self.main_dtype = policy.main_params_dtype
        self.requires_grad = params[0].requires_grad
        self.grads_dtype = policy.grads_dtype_for(self.compute_dtype) if self.requires_grad else None
        self.layout = GroupLayout.build([p.shape for p in params], self.world_size, self.rank)
        self._specs = ShardSpecs(mesh, self.layout.params)

        numel = self.layout.shard_numel
        with torch.no_grad():
            self.main_weight = torch.zeros(numel, dtype=self.main_dtype, device=device)
            for param, layout in zip(params, self.layout.params):
                rows = slice(layout.rank * layout.chunk_rows, layout.rank * layout.chunk_rows + layout.local_rows)
                layout.local_view(self.main_weight).copy_(param.detach()[rows])
            if self.compute_dtype == self.main_dtype:
                self.compute_weight = self.main_weight
            else:
                self.compute_weight = self.main_weight.to(self.compute_dtype)
        self.main_grad = (
            torch.zeros(numel, dtype=self.grads_dtype, device=device) if self.requires_grad else None
        )

        self.params: list[nn.Parameter] = []
        for view in self._specs.views(self.main_weight):
            sharded = nn.Parameter(view, requires_grad=self.requires_grad)
            if self.requires_grad:
                sharded.grad_dtype = self.grads_dtype
            self.params.append(sharded)
        self._grad_views: list[DTensor] = (
            self._specs.views(self.main_grad) if self.main_grad is not None else []
        )
        self._refreshed_version = self.weights_version()

        # Unsharded state: one padded flat buffer whose storage is freed between uses; the
        # unsharded parameters are persistent leaf views into it, so tensors that autograd
        # saved in forward stay valid once backward re-gathers into the same storage.
        self._unsharded_flat = torch.empty(self.layout.unsharded_numel, dtype=self.compute_dtype, device=device)
        self.unsharded_params: list[nn.Parameter] = [
            nn.Parameter(layout.unsharded_view(self._unsharded_flat), requires_grad=self.requires_grad)
            for layout in self.layout.params
        ]
        self._copy_out_views = [
            self._unsharded_flat[layout.unsharded_offset : layout.unsharded_offset + layout.slot_numel * self.world_size].view(
                self.world_size, layout.slot_numel
            )
            for layout in self.layout.params
        ]
        self._gathered_version: int | None = None
        self._free_unsharded()

        self._reduced_since_finalize = False
        self._overwrite_main_grad = False
        # DTensor views of the temporary cast buffer while grads are cast (they keep it alive);
        # empty otherwise. The grads they stand in for are always self._grad_views.
        self._cast_views: list[DTensor] = []

    def register(self) -> None:
        """Makes :func:`parameter_group_of` find this group's parameters."""
        for param in self.params:
            _GROUP_OF[param] = self

    # ------------------------------------------------------------------ weights
    @property
    def compute_aliases_main(self) -> bool:
        return self.compute_weight is self.main_weight

    def weights_version(self) -> int:
        """A counter that changes whenever the main weights are modified in place.

        Updates through the DTensor parameters (an optimizer step, ``load_state_dict``) bump
        the parameters' own version counters but not the flat buffer's, since DTensor runs
        the local op below autograd; direct writes to the buffer bump only the buffer's.
        """
        return self.main_weight._version + sum(p._version for p in self.params)

    def refresh_compute_weight(self) -> int:
        """Refreshes the compute copy from the main weights; one cast for the whole group.

        Returns:
            Bytes written by the cast (0 when the compute copy is the main weight itself).
        """
        written = 0
        if not self.compute_aliases_main:
            with torch.no_grad():
                self.compute_weight.copy_(self.main_weight)
            written = self.compute_weight.numel() * self.compute_weight.element_size()
        self._refreshed_version = self.weights_version()
        return written

    def _ensure_compute_fresh(self) -> None:
        # Main weights changed outside the optimizer adapter (a checkpoint load, a manual
        # edit): the compute copy must follow before anyone gathers it.
        if self.weights_version() != self._refreshed_version:
            self.refresh_compute_weight()

    @property
    def is_unsharded(self) -> bool:
        return self._gathered_version is not None

    def unshard(self) -> None:
        """All-gathers the compute copy into the unsharded parameters (no cast)."""
        self._ensure_compute_fresh()
        if self._gathered_version == self.weights_version():
            return
        flat = self._unsharded_flat
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(flat):
            storage = flat.untyped_storage()
            nbytes = flat.numel() * flat.element_size()
            if storage.size() != nbytes:
                storage.resize_(nbytes)
            if self.world_size == 1:
                flat.copy_(self.compute_weight)
            else:
                gathered = torch.empty_like(flat)
                dist.all_gather_single(gathered, self.compute_weight, group=self.process_group)
                torch.split_with_sizes_copy(
                    gathered.view(self.world_size, -1), self.layout.slot_sizes, dim=1, out=self._copy_out_views
                )
        self._gathered_version = self.weights_version()

    def _free_unsharded(self) -> None:
        self._unsharded_flat.untyped_storage().resize_(0)
        self._gathered_version = None

    def reshard(self) -> None:
        """Frees the unsharded parameters' storage; only the shards remain."""
        if self.is_unsharded:
            self._free_unsharded()

    def unsharded_storage_bytes(self) -> int:
        return self._unsharded_flat.untyped_storage().nbytes()

    # ------------------------------------------------------------------ grads
    def grad_presence(self) -> GradPresence:
        present = sum(param.grad is not None for param in self.params)
        if present == 0:
            return "none"
        return "all" if present == len(self.params) else "partial"

    def reduce_grads(self) -> None:
        """Reduce-scatters (averages) the unsharded grads into ``main_grad``, then drops them.

        Parameters that received no gradient contribute zeros, so every rank takes part in the
        same collectives whatever its control flow.
        """
        assert self.main_grad is not None
        unsharded_grads = [
            p.grad if p.grad is not None else torch.zeros_like(p) for p in self.unsharded_params
        ]
        with torch.no_grad():
            if not self._reduced_since_finalize:
                self._begin_accumulation()
            packed = torch.empty(
                self.world_size, self.layout.shard_numel, dtype=self.grads_dtype, device=self.main_grad.device
            )
            torch._chunk_cat(unsharded_grads, dim=0, num_chunks=self.world_size, out=packed)
            if self.world_size == 1:
                reduced = packed.view(-1)
            else:
                reduced = torch.empty_like(self.main_grad)
                dist.reduce_scatter_single(reduced, packed.view(-1), op=dist.ReduceOp.AVG, group=self.process_group)
            if self._overwrite_main_grad:
                self.main_grad.copy_(reduced)
                self._overwrite_main_grad = False
            else:
                self.main_grad.add_(reduced)
        for param in self.unsharded_params:
            param.grad = None
        self._reduced_since_finalize = True

    def _begin_accumulation(self) -> None:
        # Whatever the sharded parameters' .grad hold now is what the new gradient adds to:
        # nothing (after zero_grad(set_to_none=True)), our own views, or tensors a user assigned.
        self.restore_grads()
        presence = self.grad_presence()
        if presence == "none":
            self._overwrite_main_grad = True
            return
        self._overwrite_main_grad = False
        if all(p.grad is v for p, v in zip(self.params, self._grad_views)):
            return
        assert self.main_grad is not None
        for param, layout, view in zip(self.params, self.layout.params, self._grad_views):
            region = layout.local_view(self.main_grad)
            if param.grad is None:
                region.zero_()
            elif param.grad is not view:
                region.copy_(_local(param.grad))

    def finalize_grads(self) -> None:
        """Installs DTensor views of ``main_grad`` as the sharded parameters' ``.grad``."""
        if not self._reduced_since_finalize:
            return
        for param, view in zip(self.params, self._grad_views):
            if param.grad is not view:
                param.grad = view
        self._reduced_since_finalize = False

    def install_zero_grads(self) -> None:
        """Gives parameters without a grad a zeroed main-grad view as ``.grad``."""
        if self.main_grad is None:
            return
        self.restore_grads()
        with torch.no_grad():
            for param, layout, view in zip(self.params, self.layout.params, self._grad_views):
                if param.grad is None:
                    layout.local_view(self.main_grad).zero_()
                    param.grad = view

    def reset_iter_state(self) -> None:
        """Forgets an iteration an exception aborted (see ``FSDPModule.reset_iter_state``).

        Frees the unsharded storage and drops the unsharded grads (including those accumulated
        with gradient sync off). If the aborted backward had already reduced into
        ``main_grad``, the buffer no longer holds what the parameters' ``.grad`` held before,
        so their grads become ``None``: the next backward then overwrites the buffer.
        """
        self.restore_grads()
        for param in self.unsharded_params:
            param.grad = None
        if self._reduced_since_finalize:
            for param in self.params:
                param.grad = None
        self._reduced_since_finalize = False
        self._overwrite_main_grad = False
        self.reshard()

    # ------------------------------------------------------------------ temporary cast
    @property
    def grads_cast(self) -> bool:
        return bool(self._cast_views)

    def cast_grads(self, dtype: torch.dtype) -> int:
        """Temporarily replaces the group's grads by ``dtype`` copies; one cast per group.

        Foreign grads a user assigned are first folded into ``main_grad`` so that the cast
        reads exactly what the parameters' ``.grad`` held.

        Returns:
            Bytes written by the cast.

        Raises:
            RuntimeError: Some but not all of the group's grads are ``None``.
        """
        presence = self.grad_presence()
        if presence == "none" or self.main_grad is None:
            return 0
        if presence == "partial":
            raise RuntimeError(self.partial_grads_message())
        self._absorb_foreign_grads()
        cast = self.main_grad.to(dtype)
        self._cast_views = self._specs.views(cast)
        for param, view in zip(self.params, self._cast_views):
            _install_grad(param, view)
        return cast.numel() * cast.element_size()

    def restore_grads(self, carry_back: bool = True) -> None:
        """Puts the original grads back after :meth:`cast_grads`; a no-op otherwise.

        What was done to a parameter's grad while it was cast is kept: a grad set to ``None``
        (``zero_grad()`` after a failed step) stays ``None``; a tensor assigned in place of the
        cast copy, and with ``carry_back`` the cast copy's current values (changed in place,
        e.g. by ``zero_grad(set_to_none=False)``), are written back into ``main_grad``.
        ``carry_back=False`` is for the end of a step whose update does not write grads.
        """
        if not self._cast_views:
            return
        with torch.no_grad():
            for param, layout, grad, view in zip(self.params, self.layout.params, self._grad_views, self._cast_views):
                current = param.grad
                param.grad = None
                param.grad_dtype = self.grads_dtype
                if current is None:
                    continue
                if current is not view or carry_back:
                    layout.local_view(self.main_grad).copy_(_local(current))
                param.grad = grad
        self._cast_views = []

    def _absorb_foreign_grads(self) -> None:
        assert self.main_grad is not None
        with torch.no_grad():
            for param, layout, view in zip(self.params, self.layout.params, self._grad_views):
                if param.grad is not view:
                    layout.local_view(self.main_grad).copy_(_local(param.grad))
                    param.grad = view

    def partial_grads_message(self) -> str:
        missing = [n for n, p in zip(self.names, self.params) if p.grad is None]
        present = [n for n, p in zip(self.names, self.params) if p.grad is not None]
        return (
            f"FSDP parameter group ({self.compute_dtype}, main {self.main_dtype}) has grads for "
            f"{len(present)} of {len(self.params)} parameters; expected all or none. "
            f"Missing: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )

    def __repr__(self) -> str:
        return (
            f"ParameterGroup(params={len(self.params)}, compute={self.compute_dtype}, "
            f"main={self.main_dtype}, grads={self.grads_dtype}, shard_numel={self.layout.shard_numel})"
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _install_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    # A parameter refuses a grad whose dtype differs from its grad_dtype, and refuses a new
    # grad_dtype while a grad of the old dtype is attached: clear, switch, assign.
    param.grad = None
    param.grad_dtype = grad.dtype
    param.grad = grad
