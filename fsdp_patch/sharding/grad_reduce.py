"""The way of a group's grads from its unsharded parameters into its main-grad buffer.

:class:`GradReduce` packs the unsharded grads a backward left (with one presence flag per
parameter, see [Note: grad presence]), issues their reduce-scatter over the shard dimension and,
under HSDP, the all-reduce of the reduced shard over the replicas, and applies the reduces in
order into ``main_grad`` (:class:`~.main_grads.MainGrads`, which decides whether a reduce
overwrites or accumulates). Microbatches with gradient sync off are kept until the next synced
backward: packed in the main-grad dtype where that is wider than the compute dtype (as FSDP2
accumulates in its reduce dtype), on the unsharded parameters otherwise. HSDP with the all-reduce
skipped (``set_requires_all_reduce(False)``) holds the reduce-scattered grads until a backward
that all-reduces. Reduce hooks see the grads at each stage (:data:`REDUCE_INPUT`,
:data:`REDUCE_OUTPUT`, :data:`REDUCE_COPIED`).

What is reduced when is the group's (:class:`~.parameter_group.ParameterGroup`, which drives this).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..torch_interop.profiling import labelled
from .collectives import ReduceScatter, Reduction
from .layout import GroupLayout
from .main_grads import MainGrads
from .placement import MeshDims

if TYPE_CHECKING:
    from .parameter_group import ParameterGroup

# The stages of a reduce-scatter a reduce hook sees (ParameterGroup.register_reduce_hook).
REDUCE_INPUT = "input"
REDUCE_OUTPUT = "output"
REDUCE_COPIED = "copied"

__all__ = ["REDUCE_COPIED", "REDUCE_INPUT", "REDUCE_OUTPUT", "GradReduce", "ReduceHook"]

ReduceHook = Callable[["ParameterGroup", str, torch.Tensor], None]
"""``hook(group, stage, grads)``: see :meth:`GradReduce.register_hook`."""


class GradReduce:
    """The reduces of one group's grads (see the module).

    Args:
        owner: The group (held weakly; reduce hooks are called with it).
        grads: Its main grads.
        params: Its sharded parameters (the group's own list).
        unsharded_params: Its unsharded parameters, whose grads backward leaves.
        layout: Its layout.
        dims: Its mesh's dimensions.
        compute_dtype: The dtype backward computes grads in.

    Attributes:
        reduction: FSDP2's communication settings (``FSDPModule.set_gradient_divide_factor`` and
            the rest), read at each reduce-scatter.
        all_reduce_hook: Runs on this rank's reduced shard before it is added into ``main_grad``,
            and may change it (``FSDPModule.set_all_reduce_hook``: an all-reduce over another
            dimension, say).
        accumulated: Unsharded grads of microbatches accumulated with gradient sync off, packed
            as the reduce-scatter reads them, in the main-grad dtype; only when that is wider.
    """

    def __init__(
        self,
        owner: ParameterGroup,
        grads: MainGrads,
        params: Sequence[nn.Parameter],
        unsharded_params: Sequence[nn.Parameter],
        layout: GroupLayout,
        dims: MeshDims,
        compute_dtype: torch.dtype,
    ) -> None:
        self._owner = weakref.ref(owner)
        self._grads = grads
        self._params = params
        self._unsharded_params = unsharded_params
        self._layout = layout
        self._dims = dims
        self._compute_dtype = compute_dtype
        self.reduction = Reduction()
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self._accumulate_wide = torch.finfo(grads.dtype).bits > torch.finfo(compute_dtype).bits
        self.accumulated: torch.Tensor | None = None
        # HSDP with the all-reduce skipped: the reduce-scattered grads held until a backward that
        # all-reduces, as FSDP2 holds them.
        self._partial: torch.Tensor | None = None
        self._reduces: list[ReduceScatter] = []  # issued, not yet applied, in issue order
        self._reduced_since_finalize = False
        # An OrderedDict: RemovableHandle refers to it weakly, which a plain dict does not allow.
        self._hooks: OrderedDict[int, ReduceHook] = OrderedDict()

    def has_grads(self) -> bool:
        """Whether backward left grads on the unsharded parameters (or accumulated some)."""
        return self.accumulated is not None or any(p.grad is not None for p in self._unsharded_params)

    @labelled("reduce_scatter")
    def post_backward(self, sync: bool, all_reduce: bool) -> None:
        """Issues the reduce-scatter of this backward's grads (``sync``), or keeps them for the next
        synced backward; with ``all_reduce`` off under HSDP, reduces and holds them (see
        :meth:`~.parameter_group.ParameterGroup.post_backward`)."""
        if not self.has_grads():
            return
        with torch.no_grad():
            if not sync:
                if self._accumulate_wide:
                    # Autograd would accumulate the next microbatch into the compute-dtype grads.
                    # Added in the compute dtype (widened exactly by the add): a packed copy in
                    # the main-grad dtype beside the accumulated one would double the peak.
                    if self.accumulated is None:
                        self.accumulated = self._grads.pack(self._unsharded_params)
                    else:
                        self.accumulated.add_(self._grads.pack(self._unsharded_params, self._compute_dtype))
                    self._drop_unsharded_grads()
                return
            dims = self._dims
            replicas = dims.replicate_size
            if replicas > 1 and not all_reduce:
                partial = ReduceScatter.issue(
                    self._packed_grads(), dims.shard_group, dims.shard_size, False, self.reduction, replicas
                )
                self._hold_partial(partial.wait())
                partial.free()
                self._drop_unsharded_grads()
                return
            if not self._reduced_since_finalize:
                self._grads.before_write()
                self._grads.begin(self._params)
            overwrite = self._grads.next_reduce_overwrites()
            packed = self._packed_grads()
            self._run_hooks(REDUCE_INPUT, packed)
            self._reduces.append(
                ReduceScatter.issue(packed, dims.shard_group, dims.shard_size, overwrite, self.reduction, replicas)
            )
            if dims.shard_size == 1:
                self.advance()
        self._drop_unsharded_grads()
        self._reduced_since_finalize = True

    def _packed_grads(self) -> torch.Tensor:
        """This backward's unsharded grads packed as the reduce-scatter reads them, plus what
        microbatches without sync accumulated (then dropped)."""
        if self.accumulated is None:
            return self._grads.pack(self._unsharded_params)
        packed, self.accumulated = self.accumulated, None
        return packed.add_(self._grads.pack(self._unsharded_params, self._compute_dtype))

    @property
    def in_flight(self) -> bool:
        return bool(self._reduces)

    def advance(self) -> None:
        """Moves the reduces issued on: completes them into ``main_grad``; under HSDP completes
        their reduce-scatters and starts their all-reduces over the replicas instead, which
        :meth:`wait` (at the latest :meth:`finalize`) completes, so that they overlap the rest of
        backward."""
        if self._dims.replicate_group is None:
            self.wait()
            return
        for reduce in self._reduces:
            self._start_all_reduce(reduce)

    @labelled("all_reduce")
    def _start_all_reduce(self, reduce: ReduceScatter) -> None:
        if not reduce.all_reducing:
            reduce.all_reduce(self._dims.replicate_group, self._partial)
            self._partial = None

    @labelled("reduce_scatter_wait")
    def wait(self) -> None:
        """Completes the reduce-scatters issued (and HSDP's all-reduces), in order, into ``main_grad``."""
        shard_numel = self._layout.shard_numel
        while self._reduces:
            reduce = self._reduces.pop(0)
            if self._dims.replicate_group is not None:
                self._start_all_reduce(reduce)
            if self.all_reduce_hook is not None:
                self.all_reduce_hook(reduce.wait()[:shard_numel])
            if self._hooks:
                self._run_hooks(REDUCE_OUTPUT, reduce.wait()[:shard_numel])
            self._grads.apply(reduce)
            if self._hooks and reduce.overwrite and self._grads.buffer is not None:
                self._run_hooks(REDUCE_COPIED, self._grads.buffer)

    def _hold_partial(self, reduced: torch.Tensor) -> None:
        with torch.no_grad():
            self._partial = reduced.clone() if self._partial is None else self._partial.add_(reduced)

    def register_hook(self, hook: ReduceHook) -> RemovableHandle:
        """Runs ``hook(group, stage, grads)`` around each reduce-scatter of the group's grads.

        ``stage`` is :data:`REDUCE_INPUT` with the packed unsharded grads about to be reduced
        (``(world_size, shard_numel + len(params))`` rows in the main-grad dtype, presence flags
        last) and :data:`REDUCE_OUTPUT` with this rank's reduced shard before it is added into
        ``main_grad``, and :data:`REDUCE_COPIED` with ``main_grad`` where that shard replaced what
        it held (the first reduce of an accumulation: ``main_grad`` then holds exactly the shard
        the hook saw). A hook reads; it must not write any of them.
        """
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    def _run_hooks(self, stage: str, grads: torch.Tensor) -> None:
        owner = self._owner()
        if owner is None:  # pragma: no cover - the group drives its reduces
            return
        for hook in tuple(self._hooks.values()):
            hook(owner, stage, grads)

    def _drop_unsharded_grads(self) -> None:
        for param in self._unsharded_params:
            param.grad = None

    @labelled("finalize_grads")
    def finalize(self) -> None:
        """Completes the reduces in flight, installs the main-grad views as grads and runs the
        sharded parameters' post-accumulate-grad hooks (see
        :meth:`~.parameter_group.ParameterGroup.finalize_grads`)."""
        self.wait()
        if not self._reduced_since_finalize:
            return
        updated = self._grads.finish(self._params)
        self._reduced_since_finalize = False
        for index in updated:
            param = self._params[index]
            hooks = getattr(param, "_post_accumulate_grad_hooks", None)
            if hooks:
                for hook in tuple(hooks.values()):
                    hook(param)

    def reset(self) -> None:
        """Drops the unsharded, accumulated and held grads and the reduces in flight; grads an
        aborted backward's reduces made unreliable become ``None`` (see
        :meth:`~.parameter_group.ParameterGroup.reset_iter_state`)."""
        self._grads.before_write()
        self._drop_unsharded_grads()
        self.accumulated = None
        self._partial = None
        for reduce in self._reduces:
            reduce.cancel()
        self._reduces.clear()
        self._grads.abandon(self._params, accumulating=self._reduced_since_finalize)
        self._reduced_since_finalize = False
