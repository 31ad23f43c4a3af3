"""Parameter groups: the flat buffers behind a set of same-dtype sharded parameters.

A group owns, for this rank, three flat buffers in one layout (see :mod:`.layout`):

- ``main_weight``: the sharded main weights (``main_params_dtype``), which the optimizer
  updates through the group's DTensor ``Shard(0)`` parameters, whose local tensors are views
  into this buffer;
- ``compute_weight``: a sharded copy in the compute dtype, which forward and backward
  all-gather (the same tensor as ``main_weight`` when the two dtypes agree). Its lifetime is
  the policy's ``compute_copy``: ``"persistent"``, all-gathered without a cast and refreshed
  from the main weights once per optimizer step; or ``"per_gather"``, none is kept (its
  storage is 0 bytes): each all-gather casts the main weights into its own output;
- ``main_grad``: the sharded main gradients (``main_grads_dtype``), which backward
  reduce-scatters into and whose DTensor views become the parameters' ``.grad``. The views own
  it: once ``zero_grad(set_to_none=True)`` drops them, its memory is freed (as FSDP2's sharded
  grads are), and the next backward allocates it anew; ``None`` meanwhile.

Whether a parameter trains is read from its sharded parameter's ``requires_grad`` at every
forward, so ``requires_grad_`` after ``fully_shard`` is honoured: a frozen parameter gets no grad.

Every cast, refresh and zeroing is one operation on a whole buffer, never one per tensor.
"""

from __future__ import annotations

import operator
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from .dtensor_views import ShardSpecs
from .layout import GroupLayout
from .mixed_precision import MixedPrecisionPolicy
from .torch_compat import all_gather_flat, reduce_scatter_flat

__all__ = ["ParameterGroup", "parameter_group_of", "contained_in_parameter_group"]

_VERSION = operator.attrgetter("_version")

# Sharded parameter -> weak reference to its group. A registry rather than an attribute on the
# parameter, so that copies of a parameter (deepcopy, pickling of an optimizer) are not mistaken
# for FSDP-managed ones and do not drag the group's buffers along. Weak both ways: the group
# holds its parameters, so a strong value would keep the keys, and every sharded model, alive.
_GROUP_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()


def parameter_group_of(parameter: torch.Tensor) -> "ParameterGroup | None":
    """The group that manages ``parameter``, or ``None`` for a parameter FSDP does not own."""
    ref = _GROUP_OF.get(parameter)
    return None if ref is None else ref()


def contained_in_parameter_group(parameter: torch.Tensor) -> bool:
    """Whether ``parameter`` is a sharded parameter managed by ``fully_shard``."""
    return parameter_group_of(parameter) is not None


class ParameterGroup:
    """Sharded parameters of one compute dtype and their flat buffers.

    Args:
        params: Original (unsharded) parameters, all of one dtype. ``fully_shard`` also splits
            groups by ``requires_grad`` at sharding time, so that a group frozen then holds no
            main-grad buffer; toggling ``requires_grad`` later works per parameter.
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
        self.grads_dtype = policy.grads_dtype_for(self.compute_dtype)
        # Accumulating microbatches with gradient sync off happens in the main-grad dtype when it
        # is wider than the compute dtype (FSDP2 accumulates in its reduce dtype likewise).
        self._accumulate_wide = torch.finfo(self.grads_dtype).bits > torch.finfo(self.compute_dtype).bits
        self._device = device
        self.layout = GroupLayout.build([p.shape for p in params], self.world_size, self.rank)
        self._specs = ShardSpecs(mesh, self.layout.params)

        numel = self.layout.shard_numel
        with torch.no_grad():
            self.main_weight = torch.zeros(numel, dtype=self.main_dtype, device=device)
            for param, layout in zip(params, self.layout.params):
                layout.local_view(self.main_weight).copy_(param.detach()[layout.local_rows_slice])
            if self.compute_dtype == self.main_dtype:
                self.compute_weight = self.main_weight
            else:
                self.compute_weight = self.main_weight.to(self.compute_dtype)
        self.compute_copy = policy.compute_copy
        if self.compute_per_gather:
            # Only its dtype and layout remain: each all-gather casts into its own output.
            self.compute_weight.untyped_storage().resize_(0)
        # main_grad is held strongly from its allocation until its views are installed as the
        # parameters' .grad, then only through them (see the module docstring).
        self._main_grad_ref: weakref.ref[torch.Tensor] | None = None
        self._main_grad_owned: torch.Tensor | None = None
        # Per parameter, a weak reference to its DTensor view of main_grad (None: none made yet).
        self._grad_view_refs: list[weakref.ref[DTensor] | None] = [None] * len(params)

        self.params: list[nn.Parameter] = []
        for param, layout, spec in zip(params, self.layout.params, self._specs.specs(self.main_dtype)):
            # Built as nn.Parameter builds a DTensor parameter, without its detach: that runs
            # below autograd and would give the local shard a version counter of its own, and
            # writes through to_local() would then escape detect_external_writes.
            sharded = DTensor(layout.local_view(self.main_weight), spec, requires_grad=param.requires_grad)
            sharded._is_param = True  # type: ignore[attr-defined]
            sharded.grad_dtype = self.grads_dtype
            self.params.append(sharded)  # type: ignore[arg-type]
        self._index_of = {id(param): index for index, param in enumerate(self.params)}
        # Whether the compute copy lags the main weights (see refresh_compute_weight), the
        # weights version it was refreshed at, and how many refreshes it has had (an all-gather
        # is tagged with that count, so one issued before a refresh is not taken for current).
        self._compute_stale = False
        self._refreshed_version = self.weights_version()
        self._refreshes = 0

        # Unsharded state: one padded flat buffer whose storage is freed between uses; the
        # unsharded parameters are persistent leaf views into it, so tensors that autograd
        # saved in forward stay valid once backward re-gathers into the same storage.
        self._unsharded_flat = torch.empty(self.layout.unsharded_numel, dtype=self.compute_dtype, device=device)
        self.unsharded_params: list[nn.Parameter] = [
            nn.Parameter(layout.unsharded_view(self._unsharded_flat), requires_grad=param.requires_grad)
            for layout, param in zip(self.layout.params, params)
        ]
        # Zero-size parameters own no slot; torch._chunk_cat refuses empty inputs.
        self._packed_indices = [i for i, layout in enumerate(self.layout.params) if layout.slot_numel]
        self._copy_out_views = [
            self._unsharded_flat[layout.unsharded_offset : layout.unsharded_offset + layout.slot_numel * self.world_size].view(
                self.world_size, layout.slot_numel
            )
            for layout in self.layout.params
        ]
        self._gathered_refresh: int | None = None
        # (work, gathered buffer, refresh count) of an all-gather issued and not yet waited.
        self._pending_gather: tuple[Any, torch.Tensor, int] | None = None
        self._free_unsharded()

        self._reduced_since_finalize = False
        self._overwrite_main_grad = False
        # Unsharded grads of microbatches accumulated with gradient sync off, packed as the
        # reduce-scatter reads them, in the main-grad dtype; only when that is wider.
        self._accumulated: torch.Tensor | None = None
        # (work, its input, reduced shard, overwrite) of reduce-scatters issued and not yet
        # added into main_grad, in issue order; both buffers are freed once waited for.
        self._pending_reduces: list[tuple[Any, torch.Tensor, torch.Tensor, bool]] = []
        # Run before backward, install_zero_grads or reset_iter_state next write the parameters'
        # grads: whoever lent the parameters other grads (the optimizer adapter's cast) puts
        # the main-grad views back first.
        self._grad_write_hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()  # weakly referable

    @property
    def requires_grad(self) -> bool:
        """Whether any parameter of the group trains (its sharded parameter requires grad)."""
        return any(param.requires_grad for param in self.params)

    @property
    def main_grad(self) -> torch.Tensor | None:
        """The flat sharded main-grad buffer, or ``None`` while no grad of the group holds it."""
        return None if self._main_grad_ref is None else self._main_grad_ref()

    def main_grad_storage_bytes(self) -> int:
        main_grad = self.main_grad
        return 0 if main_grad is None else main_grad.untyped_storage().nbytes()

    def _ensure_main_grad(self, overwritten: bool = False) -> torch.Tensor:
        """The main-grad buffer, held by the group until its views are the parameters' grads
        again (:meth:`_install_views`). Allocated if it was freed: zeroed, unless the caller
        overwrites all of it next (``overwritten``)."""
        main_grad = self.main_grad
        if main_grad is None:
            new = torch.empty if overwritten else torch.zeros
            main_grad = new(self.layout.shard_numel, dtype=self.grads_dtype, device=self._device)
            self._main_grad_ref = weakref.ref(main_grad)
            self._grad_view_refs = [None] * len(self.params)
        self._main_grad_owned = main_grad
        return main_grad

    def _grad_view(self, index: int) -> DTensor | None:
        """The DTensor view of ``main_grad`` that is (or was) ``params[index].grad``, if it lives."""
        ref = self._grad_view_refs[index]
        return None if ref is None else ref()

    def _make_grad_view(self, index: int) -> DTensor:
        view = self._grad_view(index)
        if view is None:
            main_grad = self.main_grad
            assert main_grad is not None
            layout, spec = self.layout.params[index], self._specs.specs(main_grad.dtype)[index]
            view = DTensor(layout.local_view(main_grad), spec, requires_grad=False)
            self._grad_view_refs[index] = weakref.ref(view)
        return view

    def register(self) -> None:
        """Makes :func:`parameter_group_of` find this group's parameters."""
        for param in self.params:
            _GROUP_OF[param] = weakref.ref(self)

    def index_of(self, param: torch.Tensor) -> int:
        """Position of one of this group's sharded parameters in :attr:`params`."""
        return self._index_of[id(param)]

    # ------------------------------------------------------------------ weights
    @property
    def compute_aliases_main(self) -> bool:
        return self.compute_weight is self.main_weight

    def weights_version(self) -> int:
        """A counter that changes whenever the main weights are modified in place.

        Updates through the DTensor parameters (an optimizer step, ``load_state_dict``, a manual
        in-place edit) bump the parameters' own version counters but not the flat buffer's,
        since DTensor runs the local op below autograd; direct writes to the buffer or to a
        view of it (``dcp.load`` writes into the local shards) bump only the buffer's.
        """
        return self.main_weight._version + sum(map(_VERSION, self.params))

    @property
    def compute_stale(self) -> bool:
        """Whether the compute copy lags the main weights: the next gather refreshes it first."""
        return self._compute_stale

    def mark_weights_changed(self) -> None:
        """Notes a write to the main weights made outside the optimizer adapter."""
        self._compute_stale = True

    def detect_external_writes(self) -> None:
        """Marks the compute copy stale if the main weights changed since its last refresh.

        Anything may write the main weights in place (a ``dcp.load`` into the tensors
        ``get_model_state_dict`` returned, ``load_state_dict``, a manual edit under
        ``no_grad``, an optimizer that is not adapted); version counters catch all of them.
        Summing them costs one read per parameter, so this runs once per iteration (the root's
        pre-forward) and at an explicit ``unshard``, not at every all-gather.

        Alternatives considered:
            - Summing at every all-gather (the first design): two to three sums per unit and
              iteration, and one per optimizer step.
            - A flag set by each known writer only (the adapter, ``load_state_dict``): an in-place
              edit of a DTensor parameter or an unadapted optimizer's step would go unseen.
        """
        if not self._compute_stale and self.weights_version() != self._refreshed_version:
            self._compute_stale = True

    def state_dict_tensor(self, index: int) -> DTensor:
        """``params[index]``'s entry in a state dict: a DTensor over the same memory whose local
        shard shares the main weights' version counter (``Module.state_dict`` detaches below
        autograd, which would not), so that a ``dcp.load`` into it is seen."""
        layout = self.layout.params[index]
        return DTensor(layout.local_view(self.main_weight).detach(), self._specs.specs(self.main_dtype)[index], requires_grad=False)

    @property
    def compute_per_gather(self) -> bool:
        """Whether no compute copy is kept, each all-gather casting the main weights itself
        (``compute_copy="per_gather"``, compute dtype not the main dtype): the optimizer
        adapter then marks the weights changed instead of refreshing, and precision
        diagnostics derive the compute weights by the same cast."""
        return self.compute_copy == "per_gather" and not self.compute_aliases_main

    def compute_storage_bytes(self) -> int:
        """Bytes the compute copy holds now (0 when it is the main weight, or released)."""
        return 0 if self.compute_aliases_main else self.compute_weight.untyped_storage().nbytes()

    def refresh_compute_weight(self) -> int:
        """Refreshes the compute copy from the main weights; one cast for the whole group.

        A ``per_gather`` group keeps no copy (each all-gather casts its own); a refresh then
        only notes that the main weights changed.

        Returns:
            Bytes written by the cast (0 when the compute copy is the main weight itself, or
            none is kept).
        """
        written = 0
        compute = self.compute_weight
        if not self.compute_aliases_main and not self.compute_per_gather:
            with torch.no_grad():
                compute.copy_(self.main_weight)
            written = compute.numel() * compute.element_size()
        self._compute_stale = False
        self._refreshed_version = self.weights_version()
        self._refreshes += 1
        return written

    def check_replacement(self, index: int, replacement: object) -> None:
        """Raises if ``replacement`` cannot stand in for ``params[index]`` (see :meth:`adopt`).

        Raises:
            TypeError: ``replacement`` is not a floating-point tensor.
            ValueError: Its shape differs from the parameter's, or it is a DTensor on another mesh.
        """
        name = self.names[index]
        layout = self.layout.params[index]
        if not isinstance(replacement, torch.Tensor) or not replacement.is_floating_point():
            raise TypeError(
                f"fully_shard: parameter '{name}' was replaced by {type(replacement).__name__}"
                f"{'' if not isinstance(replacement, torch.Tensor) else f' of dtype {replacement.dtype}'}; "
                "expected a floating-point tensor"
            )
        if tuple(replacement.shape) != tuple(layout.global_shape):
            raise ValueError(
                f"fully_shard: parameter '{name}' was replaced by a tensor of shape {tuple(replacement.shape)}; "
                f"expected its global shape {tuple(layout.global_shape)}"
            )
        if isinstance(replacement, DTensor) and replacement.device_mesh != self.mesh:
            raise ValueError(
                f"fully_shard: parameter '{name}' was replaced by a DTensor on {replacement.device_mesh}; "
                f"expected one on the unit's mesh {self.mesh}"
            )

    def adopt(self, index: int, replacement: torch.Tensor) -> None:
        """Copies the values of a tensor that replaced ``params[index]`` in its module
        (``load_state_dict(assign=True)``, a plain attribute assignment) into the main weights.

        The group's own sharded parameter stays the module's parameter, so optimizers built
        earlier keep stepping it; ``requires_grad`` follows the replacement. A ``Shard(0)``
        DTensor gives its local shard; another DTensor is gathered first (a collective: every
        rank adopts at the same forward); a plain tensor is the full value. Call
        :meth:`check_replacement` first.
        """
        layout = self.layout.params[index]
        with torch.no_grad():
            if isinstance(replacement, DTensor):
                local = (
                    replacement.to_local()
                    if tuple(replacement.placements) == (Shard(0),)
                    else replacement.full_tensor()[layout.local_rows_slice]
                )
            else:
                local = replacement.detach()[layout.local_rows_slice]
            layout.local_view(self.main_weight).copy_(local)
        self._compute_stale = True
        self.params[index].requires_grad_(replacement.requires_grad)

    @property
    def is_unsharded(self) -> bool:
        """Whether the unsharded parameters hold the gathered weights (or a gather is in flight)."""
        return self._gathered_refresh is not None or self._pending_gather is not None

    def unshard(self) -> None:
        """All-gathers the compute copy into the unsharded parameters (no cast)."""
        self.start_unshard()
        self.wait_unshard()

    def start_unshard(self) -> None:
        """Issues the all-gather without waiting for it (a prefetch); :meth:`wait_unshard`
        completes it. A no-op when the current weights are gathered or in flight."""
        if self._compute_stale:
            # Main weights changed outside the optimizer adapter (a checkpoint load, a manual
            # edit): the compute copy must follow before anyone gathers it.
            self.refresh_compute_weight()
        refresh = self._refreshes
        pending = self._pending_gather
        if self._gathered_refresh == refresh or (pending is not None and pending[2] == refresh):
            return
        if pending is not None:
            self._drop_pending_gather()
        flat = self._unsharded_flat
        if self.world_size == 1:
            self._materialize_unsharded()
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(flat):
                flat.copy_(self.main_weight if self.compute_per_gather else self.compute_weight)
            self._gathered_refresh = refresh
            return
        self._gathered_refresh = None
        gathered = torch.empty_like(flat)
        source = self.compute_weight
        if self.compute_per_gather:
            # Cast into this rank's slot of the output and gather in place, as FSDP2 does:
            # the per-gather copy needs no memory of its own.
            source = gathered.view(self.world_size, -1)[self.rank]
            with torch.no_grad():
                source.copy_(self.main_weight)
        work = all_gather_flat(gathered, source, group=self.process_group, async_op=True)
        self._pending_gather = (work, gathered, refresh)

    def wait_unshard(self) -> None:
        """Completes an all-gather :meth:`start_unshard` issued: waits for it and copies the
        ranks' slots out into the unsharded parameters."""
        if self._pending_gather is None:
            return
        work, gathered, refresh = self._pending_gather
        self._pending_gather = None
        work.wait()
        # Allocated only now, as FSDP2 allocates its unsharded parameters at the copy-out:
        # while the all-gather is in flight only its output buffer exists.
        flat = self._materialize_unsharded()
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(flat):
            torch.split_with_sizes_copy(
                gathered.view(self.world_size, -1), self.layout.slot_sizes, dim=1, out=self._copy_out_views
            )
        _free(gathered)
        self._gathered_refresh = refresh

    def _materialize_unsharded(self) -> torch.Tensor:
        flat = self._unsharded_flat
        storage = flat.untyped_storage()
        nbytes = flat.numel() * flat.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)
        return flat

    def _drop_pending_gather(self) -> None:
        # A collective cannot be cancelled: wait for it, then forget its result.
        if self._pending_gather is not None:
            work, gathered, _ = self._pending_gather
            self._pending_gather = None
            work.wait()
            _free(gathered)

    def _free_unsharded(self) -> None:
        self._drop_pending_gather()
        self._unsharded_flat.untyped_storage().resize_(0)
        self._gathered_refresh = None

    def reshard(self) -> None:
        """Frees the unsharded parameters' storage (after an all-gather in flight completes)."""
        if self.is_unsharded:
            self._free_unsharded()

    def unsharded_storage_bytes(self) -> int:
        """Bytes held for the unsharded state: the unsharded parameters' storage and the output
        of an all-gather in flight (whose copy-out allocates the former)."""
        pending = self._pending_gather
        in_flight = 0 if pending is None else pending[1].untyped_storage().nbytes()
        return self._unsharded_flat.untyped_storage().nbytes() + in_flight

    # ------------------------------------------------------------------ grads
    def has_unsharded_grads(self) -> bool:
        """Whether backward left grads on the unsharded parameters (or accumulated some)."""
        return self._accumulated is not None or any(p.grad is not None for p in self.unsharded_params)

    def post_backward(self, sync: bool) -> None:
        """Reduce-scatters the unsharded grads into ``main_grad`` (``sync``), or keeps them for
        the next synced backward; a no-op when backward produced no grads for this group.

        Skipping when there are no grads leaves ``torch.autograd.grad`` (which fills no
        ``.grad``) alone; within a group, a parameter without a grad contributes zeros, so
        every rank takes part in the same collectives whatever its control flow inside the group.
        """
        if not self.has_unsharded_grads():
            return
        if not sync:
            if self._accumulate_wide:
                # Autograd would accumulate the next microbatch into the compute-dtype grads.
                with torch.no_grad():
                    packed = self._pack_unsharded_grads()
                    if self._accumulated is None:
                        self._accumulated = packed
                    else:
                        self._accumulated.add_(packed)
                self._drop_unsharded_grads()
            return
        with torch.no_grad():
            if not self._reduced_since_finalize:
                self._begin_accumulation()
            overwrite, self._overwrite_main_grad = self._overwrite_main_grad, False
            main_grad = self._ensure_main_grad(overwritten=overwrite)  # the reduced shard covers it all
            packed = self._pack_unsharded_grads()
            if self._accumulated is not None:
                packed.add_(self._accumulated)
                self._accumulated = None
            if self.world_size == 1:
                self._apply_reduced(packed.view(-1), overwrite)
            else:
                reduced = torch.empty_like(main_grad)
                work = reduce_scatter_flat(
                    reduced, packed.view(-1), op=dist.ReduceOp.AVG, group=self.process_group, async_op=True
                )
                self._pending_reduces.append((work, packed, reduced, overwrite))
        self._drop_unsharded_grads()
        self._reduced_since_finalize = True

    @property
    def reduce_in_flight(self) -> bool:
        return bool(self._pending_reduces)

    def wait_reduce(self) -> None:
        """Completes the reduce-scatters :meth:`post_backward` issued, in order, into ``main_grad``."""
        while self._pending_reduces:
            work, packed, reduced, overwrite = self._pending_reduces.pop(0)
            work.wait()
            _free(packed)
            with torch.no_grad():
                self._apply_reduced(reduced, overwrite)
            _free(reduced)

    def _apply_reduced(self, reduced: torch.Tensor, overwrite: bool) -> None:
        assert self.main_grad is not None
        if overwrite:
            self.main_grad.copy_(reduced)
        else:
            self.main_grad.add_(reduced)

    def _pack_unsharded_grads(self) -> torch.Tensor:
        """The unsharded grads (zeros for missing ones) as ``(world_size, shard_numel)`` rows in
        the main-grad dtype: row ``r`` is what rank ``r`` receives."""
        packed = torch.empty(self.world_size, self.layout.shard_numel, dtype=self.grads_dtype, device=self._device)
        grads = []
        for index in self._packed_indices:
            param = self.unsharded_params[index]
            grads.append(param.grad if param.grad is not None else torch.zeros_like(param))
        if grads:
            torch._chunk_cat(grads, dim=0, num_chunks=self.world_size, out=packed)
        return packed

    def _drop_unsharded_grads(self) -> None:
        for param in self.unsharded_params:
            param.grad = None

    def _begin_accumulation(self) -> None:
        # Whatever the sharded parameters' .grad hold now is what the new gradient adds to:
        # nothing (after zero_grad(set_to_none=True)), our own views, or tensors a user assigned.
        self._before_grad_write()
        if all(p.grad is None for p in self.params):
            # A fresh buffer: a tensor someone kept from before zero_grad is not written to.
            self._main_grad_ref = None
            self._overwrite_main_grad = True
            return
        self._overwrite_main_grad = False
        main_grad = self._ensure_main_grad()
        if all(p.grad is self._grad_view(i) for i, p in enumerate(self.params)):
            return
        for index, (param, layout) in enumerate(zip(self.params, self.layout.params)):
            region = layout.local_view(main_grad)
            if param.grad is None:
                region.zero_()
            elif param.grad is not self._grad_view(index):
                region.copy_(_local(param.grad))

    def finalize_grads(self) -> None:
        """Completes the reduce-scatters in flight and installs DTensor views of ``main_grad``
        as the ``.grad`` of every trainable sharded parameter; a frozen one keeps what it has
        (``None`` unless a user assigned a grad)."""
        self.wait_reduce()
        if not self._reduced_since_finalize:
            return
        self._install_views(lambda param: param.requires_grad)
        self._reduced_since_finalize = False

    def _install_views(self, wanted: Any) -> None:
        """Makes the main-grad views the ``.grad`` of the parameters ``wanted(param)`` selects;
        from then on they, not the group, own the buffer."""
        self._ensure_main_grad()
        for index, param in enumerate(self.params):
            if wanted(param):
                view = self._make_grad_view(index)
                if param.grad is not view:
                    param.grad = view
        self._main_grad_owned = None

    def install_zero_grads(self) -> None:
        """Gives trainable parameters without a grad a zeroed main-grad view as ``.grad``."""
        if not self.requires_grad:
            return
        self._before_grad_write()
        main_grad = self._ensure_main_grad()
        with torch.no_grad():
            for param, layout in zip(self.params, self.layout.params):
                if param.grad is None and param.requires_grad:
                    layout.local_view(main_grad).zero_()
        self._install_views(lambda param: param.grad is None and param.requires_grad)

    def reset_iter_state(self) -> None:
        """Forgets an iteration an exception aborted (see ``FSDPModule.reset_iter_state``).

        Frees the unsharded storage and drops the unsharded grads (including those accumulated
        with gradient sync off). If the aborted backward had already reduced into
        ``main_grad``, the buffer no longer holds what the parameters' ``.grad`` held before,
        so their grads become ``None``: the next backward then overwrites the buffer.
        """
        self._before_grad_write()
        self._drop_unsharded_grads()
        self._accumulated = None
        for work, _, _, _ in self._pending_reduces:
            work.wait()
        self._pending_reduces.clear()
        if self._reduced_since_finalize:
            for param in self.params:
                param.grad = None
        self._reduced_since_finalize = False
        self._overwrite_main_grad = False
        self.reshard()

    # ------------------------------------------------------------------ lending grads
    def register_grad_write_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """Runs ``hook()`` before the group next writes its parameters' grads: at the start of
        a backward's accumulation, in :meth:`install_zero_grads` and :meth:`reset_iter_state`.

        For whoever replaced some ``.grad`` by other tensors for a while (the optimizer
        adapter's temporary cast): the hook puts the main-grad views back. It stays registered
        until its handle is removed.
        """
        handle = RemovableHandle(self._grad_write_hooks)
        self._grad_write_hooks[handle.id] = hook
        return handle

    @property
    def grad_write_hooks(self) -> tuple[Callable[[], None], ...]:
        return tuple(self._grad_write_hooks.values())

    def _before_grad_write(self) -> None:
        if self._grad_write_hooks:
            for hook in list(self._grad_write_hooks.values()):
                hook()

    def grad_views(self, indices: Sequence[int]) -> list[DTensor | None]:
        """The live main-grad views of ``params[i]`` for ``i`` in ``indices`` (``None`` where
        none lives): what those parameters' ``.grad`` are when nobody replaced them."""
        refs = self._grad_view_refs
        if not refs:
            return [None] * len(indices)
        if len(indices) == len(refs):  # all of them (indices are sorted distinct positions)
            return list(map(operator.call, refs))
        return [refs[i]() for i in indices]

    def dtensor_specs(self, dtype: torch.dtype) -> list[Any]:
        """One ``DTensorSpec`` per parameter for a shard of ``dtype`` (cached): to build
        DTensor views of a flat buffer laid out as the group's (see :attr:`layout`)."""
        return self._specs.specs(dtype)

    def adopt_foreign_grads(self, indices: Sequence[int]) -> torch.Tensor:
        """Makes ``params[i].grad``, for ``i`` in ``indices`` whose grad is not ``None``, views
        of ``main_grad`` holding their values (copying tensors a user assigned); returns
        ``main_grad``."""
        main_grad = self._ensure_main_grad()
        params = self.params
        foreign = [i for i in indices if params[i].grad is not None and params[i].grad is not self._grad_view(i)]
        with torch.no_grad():
            for index in foreign:
                self.layout.params[index].local_view(main_grad).copy_(_local(params[index].grad))
        chosen = set(foreign)
        self._install_views(lambda param: self._index_of[id(param)] in chosen)
        return main_grad

    def __repr__(self) -> str:
        return (
            f"ParameterGroup(params={len(self.params)}, compute={self.compute_dtype}, "
            f"main={self.main_dtype}, grads={self.grads_dtype}, shard_numel={self.layout.shard_numel})"
        )


def _free(tensor: torch.Tensor) -> None:
    """Frees a collective's buffer now: a completed asynchronous work may still hold a
    reference to it until the backend's thread lets go, which would make the peak depend on
    timing."""
    tensor.untyped_storage().resize_(0)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
