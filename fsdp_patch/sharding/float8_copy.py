"""The float8 compute copy: torchao's tensorwise float8 weights kept, refreshed and all-gathered in float8.

A group of torchao ``Float8Linear`` weights converted with ``enable_fsdp_float8_all_gather=True``
(:class:`~.all_gather_extension.Float8Weight`) keeps, instead of a compute-dtype copy, its
weights cast to float8 with one scale per weight, and gathers those bytes; its unsharded
parameters are torchao ``Float8TrainingTensor`` s over the gathered data, which ``Float8Linear``
computes with as they are, as it does under FSDP2's float8 all-gather.

[Note: the float8 compute copy]
What FSDP2 does through torchao's extension, here as a lifetime of the compute copy:

- the copy is a flat float8 buffer in the group's layout (1 byte per element, half a bf16
  copy's) with one float32 scale per weight, ``finfo(float8).max / amax`` of the whole weight,
  as torchao computes it (``EPS`` floor, float64 division);
- :meth:`Float8ComputeCopy.refresh` computes every weight's amax over this rank's rows, reduces
  them over the shard group in one all-reduce (MAX), and casts each weight with its scale,
  saturated, as torchao's ``hp_tensor_and_scale_to_float8`` casts the fp32 weight: the bytes
  FSDP2 gathers after ``precompute_float8_dynamic_scale_for_fsdp``. The copy is refreshed when
  every compute copy is ([Note: compute-copy freshness] in :mod:`.parameter_group`): by the
  optimizer adapter after the step, and at the iteration's first all-gather, so that writes to
  the main weights outside the optimizer reach forward. The all-reduce runs once per step: after
  the adapter's refresh, the gathers of the iteration's forwards cast again with the scales it
  reduced (as FSDP2 casts with the precomputed scale), and reduce anew only where no adapter
  refreshed (an optimizer fully_shard_optimizer did not adapt), or the weights were loaded
  (``load_state_dict``, an adopted replacement).
  A write outside the optimizer that grows a weight past its amax is then clamped at float8's
  largest value until the next step, as under FSDP2; the float8 cast watch of the telemetry
  reports it (``float8_saturation``);
- the all-gather moves the buffer's bytes as ``uint8`` on every backend (gloo has no float8
  type; the bytes are the same on NCCL), and the gathered output is read back as float8;
- the scales are the same on every rank after the all-reduce, so they are not gathered: each
  gather takes a copy of those it was cast with, and the unsharded ``Float8TrainingTensor`` s
  read them once it completes (:meth:`Float8ComputeCopy.post_gather`), so that a refresh while a
  gather is in flight or held never pairs data with another refresh's scales.

Backward computes the weight's grad in the compute dtype (``Float8Linear`` returns it in the
dtype of the unsharded parameter, ``Float8TrainingTensor``'s original dtype), which reduces as
any group's grads do.

Alternatives considered:
    - Calling torchao's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` at each gather: a
      cast and an all-reduce per gather (forward, backward's re-gather, each microbatch), and a
      gather path of its own (:mod:`.all_gather_extension`).
    - Gathering the scales with the data: every rank holds the same scales after the
      all-reduce; a copy at issue costs 4 bytes per weight and no collective.
    - Gathering float8 where the backend has the type: the byte view costs nothing and is the
      same on every backend.
    - Reducing the amax again at the first gather of every iteration: a second all-reduce per
      step for what is, but for writes outside the optimizer, the step's amax.
    - Each rank deciding whether its weights changed since the refresh: the ranks would disagree
      on whether to run the all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .all_gather_extension import Float8Weight
from .compute_copy import ComputeCopy
from .flat_buffer import ShardedBuffer

__all__ = ["Float8ComputeCopy"]

# torchao's floor on an amax (torchao.float8.float8_utils.EPS): an all-zero weight gets a finite scale.
_AMAX_FLOOR = 1e-12


class Float8ComputeCopy(ComputeCopy):
    """A group's weights in float8 with one scale per weight (see the note above).

    Args:
        main: The main weights.
        weight: The float8 dtype and torchao matmul config of the group's weights.
        compute_dtype: The dtype of the unsharded parameters' values and grads (the module's).
        process_group: The shard group the amax is reduced over (``None``: one rank).

    Attributes:
        scales: The scale of each weight at the latest refresh.
        unsharded_scales: The scales of the data the unsharded parameters hold, which their
            ``Float8TrainingTensor`` s read.
    """

    def __init__(
        self, main: ShardedBuffer, weight: Float8Weight, compute_dtype: torch.dtype, process_group: Any
    ) -> None:
        self.main = main
        self.lifetime = "persistent"
        self.weight = weight
        self._compute_dtype = compute_dtype
        self._process_group = process_group
        layout = main.layout
        self.buffer = ShardedBuffer(
            torch.zeros(layout.shard_numel, dtype=weight.dtype, device=main.tensor.device), layout, main._specs
        )
        count = len(layout.params)
        self.scales = torch.ones(count, dtype=torch.float32, device=main.tensor.device)
        self.unsharded_scales = torch.ones(count, dtype=torch.float32, device=main.tensor.device)
        self._main_views = [main.local(i) for i in range(count)]
        self._views = [self.buffer.local(i) for i in range(count)]
        # Cast at the first gather: the scales need an all-reduce, which fully_shard does not run.
        self.stale = True
        self.refreshes = 0
        self.amax_reductions = 0
        self._step_scales = False  # the scales are those the adapter's refresh reduced after a step
        self._recast_only = False  # the next refresh keeps the scales

    def invalidate(self) -> None:
        """A root forward: cast again at the next gather, with the scales of the adapter's refresh
        after the last step (no all-reduce), else with new ones."""
        self.stale = True
        self._recast_only = self._step_scales

    def weights_changed(self) -> None:
        self.stale = True
        self._recast_only = self._step_scales = False

    @property
    def gather_dtype(self) -> torch.dtype:
        return torch.uint8

    def refresh(self, after_step: bool = False) -> int:
        """Reduces every weight's amax over the shard group (one all-reduce; none where a gather
        casts again after the adapter's refresh, see the note), and casts the main weights into
        the copy with the scales it gives; returns the bytes written."""
        finfo = torch.finfo(self.weight.dtype)
        with torch.no_grad():
            if after_step or not self._recast_only:
                self._reduce_scales(finfo.max)
                self._step_scales = after_step
            self._recast_only = False
            if self._main_views:
                wide = [view.float() for view in self._main_views]
                scaled = torch._foreach_mul(wide, list(self.scales.unbind()))
                torch._foreach_clamp_min_(scaled, -finfo.max)
                torch._foreach_clamp_max_(scaled, finfo.max)
                torch._foreach_copy_(self._views, scaled)
        self.stale = False
        self.refreshes += 1
        return self.buffer.full_nbytes

    def _reduce_scales(self, largest: float) -> None:
        if self._main_views:
            amax = torch.stack(torch._foreach_norm(self._main_views, ord=float("inf"))).float()
        else:
            amax = torch.zeros(0, dtype=torch.float32, device=self.scales.device)
        if self._process_group is not None and dist.get_world_size(self._process_group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self._process_group)
        self.scales.copy_(largest / amax.double().clamp(min=_AMAX_FLOOR))
        self.amax_reductions += 1

    def gather_input(self, output: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
        return self.to_gathered(self.buffer.tensor)

    def gather_metadata(self) -> torch.Tensor:
        """The scales the copy was cast with, for the gather issued now."""
        return self.scales.clone()

    def post_gather(self, metadata: Any) -> None:
        """Hands the scales a completed gather was cast with to the unsharded parameters."""
        if metadata is not None:
            self.unsharded_scales.copy_(metadata)

    def unsharded_data(self, index: int, view: torch.Tensor) -> torch.Tensor:
        """Weight ``index``'s unsharded parameter over ``view`` of the unsharded float8 buffer:
        torchao's ``Float8TrainingTensor`` with the scale of the data gathered into it."""
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        return Float8TrainingTensor(
            view, self.unsharded_scales[index], self._compute_dtype, self.weight.mm_config, GemmInputRole.WEIGHT
        )
