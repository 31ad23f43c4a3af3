"""A group's unsharded parameters: all-gathered from the compute copy, kept, partly kept after
forward, and freed.

:class:`Unsharding` issues the all-gather of the compute copy (:class:`~.compute_copy.ComputeCopy`)
and copies its output into the unsharded parameters' storage (:class:`~.flat_buffer.UnshardedBuffer`)
when it is waited; every gather carries the refresh count of the copy it read, and the unsharded
parameters hold one only while it is current ([Note: compute-copy freshness] in
:mod:`.parameter_group`, whose group refreshes the copy before it asks for a gather). With
``reshard_after_forward=<int>`` it keeps part of the gathered rows after forward
([Note: resharding to a smaller group after forward]).
"""

from __future__ import annotations

from typing import Any

import torch

from ..torch_interop.profiling import labelled
from .collectives import AllGather
from .compute_copy import ComputeCopy
from .flat_buffer import UnshardedBuffer
from .layout import GroupLayout
from .placement import MeshDims

__all__ = ["Unsharding"]


class Unsharding:
    """The unsharded state of one group (see the module).

    Args:
        buffer: The unsharded parameters' storage.
        copy: The compute copy the gathers read (and the dtype they move: see
            :attr:`~.compute_copy.ComputeCopy.gather_dtype`).
        layout: The group's layout.
        dims: Its mesh's dimensions (gathers run over the shard dimension).
        device: This rank's device.

    Attributes:
        all_gather_comm: FSDP2's all-gather communication setting (``FSDPModule.set_custom_all_gather``).
        post_forward_group: With ``reshard_after_forward=<int>``, the group of ranks that re-gathers
            in backward, this rank's position in it and its size (``None``: all freed after forward).
    """

    def __init__(
        self,
        buffer: UnshardedBuffer,
        copy: ComputeCopy,
        layout: GroupLayout,
        dims: MeshDims,
        device: torch.device,
    ) -> None:
        self._unsharded = buffer
        self._copy = copy
        self._layout = layout
        self._dims = dims
        self._device = device
        self.all_gather_comm: Any = None
        self._gathered_refresh: int | None = None  # the refresh count the unsharded params hold
        self._gather: AllGather | None = None  # issued, not yet waited
        self.post_forward_group: tuple[Any, int, int] | None = None  # (process group, position, size)
        # The rows this rank kept after forward, with the refresh count they hold.
        self._post_forward_rows: torch.Tensor | None = None
        self._post_forward_refresh: int | None = None

    @property
    def is_unsharded(self) -> bool:
        """Whether the unsharded parameters hold the gathered weights (or a gather is in flight)."""
        return self._gathered_refresh is not None or self._gather is not None

    @property
    def gather_in_flight(self) -> bool:
        return self._gather is not None

    def holds_current_gather(self) -> bool:
        """Whether the unsharded parameters hold, or an all-gather in flight brings, the compute
        copy of the latest refresh."""
        refresh = self._copy.refreshes
        return self._gathered_refresh == refresh or (self._gather is not None and self._gather.tag == refresh)

    def start(self) -> None:
        """Issues the all-gather of the compute copy as it is (refreshed by the caller), without
        waiting for it; a no-op when the current weights are gathered or in flight."""
        if self.holds_current_gather():
            return
        refresh = self._copy.refreshes
        self._cancel_gather()
        if self._post_forward_rows is not None and self._post_forward_refresh == refresh:
            self._start_post_forward(refresh)
            return
        dims = self._dims
        if dims.shard_size == 1:
            self._unsharded.copy_single(self._copy.single_rank_source)
            self._copy.post_gather(self._copy.gather_metadata())
            self._gathered_refresh = refresh
            return
        self._gathered_refresh = None
        comm = self.all_gather_comm
        output = AllGather.allocate_output(self._layout.unsharded_numel, self._copy.gather_dtype, self._device, comm)
        shard = self._copy.gather_input(output, dims.shard_size, dims.shard_rank)
        metadata = self._copy.gather_metadata()
        self._gather = AllGather.issue(output, shard, dims.shard_group, refresh, comm, metadata)

    def _start_post_forward(self, refresh: int) -> None:
        """Gathers the rows each rank of the post-forward group kept into a whole all-gather
        output: the group's positions hold consecutive runs of rank-major rows."""
        assert self.post_forward_group is not None and self._post_forward_rows is not None
        process_group, _, _ = self.post_forward_group
        comm = self.all_gather_comm
        output = AllGather.allocate_output(self._layout.unsharded_numel, self._copy.gather_dtype, self._device, comm)
        self._gathered_refresh = None
        # The rows hold the refresh the unsharded parameters held: no metadata to hand over.
        rows = self._copy.to_gathered(self._post_forward_rows.view(-1))
        self._gather = AllGather.issue(output, rows, process_group, refresh, comm)

    @labelled("all_gather_wait")
    def wait(self) -> None:
        """Completes an all-gather :meth:`start` issued: waits for it and copies the ranks' slots
        out into the unsharded parameters."""
        gather, self._gather = self._gather, None
        if gather is None:
            return
        # The unsharded storage is allocated only at the copy-out, as FSDP2 allocates its
        # unsharded parameters: while the all-gather is in flight only its output exists.
        self._unsharded.copy_out(self._copy.from_gathered(gather.wait()))
        self._copy.post_gather(gather.metadata)
        gather.free()
        self._gathered_refresh = gather.tag
        self._post_forward_rows = self._post_forward_refresh = None  # the unsharded parameters hold them

    def reshard_after_forward(self) -> None:
        """Frees the unsharded parameters after forward: all of them, or with a post-forward
        group, all but the part this rank keeps for backward's re-gather.

        [Note: resharding to a smaller group after forward]
        With ``reshard_after_forward=<int>`` (FSDP2's), a unit keeps after forward a
        ``1/size`` part of its unsharded parameters instead of freeing them all: the rows, in the
        all-gather's rank-major order, that its position in a group of ``size`` consecutive
        ranks contributes when the group re-gathers in backward. That all-gather runs over
        ``size`` ranks instead of the whole mesh (within a node, say), at the cost of the kept
        part's memory between forward and backward. The kept rows are used only while they
        hold the current refresh; otherwise backward gathers from the compute copy as usual."""
        if self.post_forward_group is None:
            self.reshard()
            return
        if self._gather is not None:
            self.wait()
        if self._gathered_refresh is None:
            self.reshard()
            return
        _, position, size = self.post_forward_group
        per_position = self._dims.shard_size // size
        rows = self._unsharded.pack_rows(slice(position * per_position, (position + 1) * per_position))
        refresh = self._gathered_refresh
        self.reshard()
        self._post_forward_rows, self._post_forward_refresh = rows, refresh

    def _cancel_gather(self) -> None:
        gather, self._gather = self._gather, None
        if gather is not None:
            gather.cancel()

    @labelled("reshard")
    def reshard(self) -> None:
        """Frees the unsharded parameters' storage (after an all-gather in flight completes)
        and the rows kept after forward."""
        self._post_forward_rows = self._post_forward_refresh = None
        if self.is_unsharded:
            self._cancel_gather()
            self._unsharded.free()
            self._gathered_refresh = None

    def storage_bytes(self) -> int:
        """Bytes held for the unsharded state: the unsharded parameters' storage and the output
        of an all-gather in flight (whose copy-out allocates the former)."""
        in_flight = 0 if self._gather is None else self._gather.nbytes
        kept = 0 if self._post_forward_rows is None else self._post_forward_rows.untyped_storage().nbytes()
        return self._unsharded.storage_bytes + in_flight + kept
