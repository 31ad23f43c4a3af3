"""DTensor ``Shard(0)`` views over flat-buffer slices, built without autograd overhead."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .layout import ParamLayout

__all__ = ["ShardSpecs"]


class ShardSpecs:
    """Caches one ``DTensorSpec`` per (parameter, dtype) of a group.

    Building a spec is pure Python work; the optimizer adapter needs fresh DTensor views of a
    cast buffer on every step, so the specs are reused across steps.
    """

    def __init__(self, mesh: DeviceMesh, layouts: tuple[ParamLayout, ...]) -> None:
        self._mesh = mesh
        self._layouts = layouts
        self._specs: dict[torch.dtype, list[DTensorSpec]] = {}

    def specs(self, dtype: torch.dtype) -> list[DTensorSpec]:
        specs = self._specs.get(dtype)
        if specs is None:
            specs = [
                DTensorSpec(
                    self._mesh,
                    (Shard(0),),
                    tensor_meta=TensorMeta(layout.global_shape, layout.global_stride, dtype),
                )
                for layout in self._layouts
            ]
            self._specs[dtype] = specs
        return specs

    def views(self, flat: torch.Tensor) -> list[DTensor]:
        """DTensor views of every parameter's shard in ``flat`` (no autograd, no copy)."""
        return [
            DTensor(layout.local_view(flat), spec, requires_grad=False)
            for layout, spec in zip(self._layouts, self.specs(flat.dtype))
        ]
