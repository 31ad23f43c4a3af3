"""DTensor views of a group's flat buffers: one cached ``DTensorSpec`` per (parameter, dtype), and
the wrapper every sharded parameter, grad and state-dict value is built with.

[Note: a DTensor over a view at an offset]
A parameter's shard is a view at an offset into its group's flat buffer. ``DTensor(local, ...)``
gives the wrapper the local tensor's storage offset, so the wrapper (which has no storage of its
own) reports a non-zero ``data_ptr``; ``torch.save``, ``pickle`` and ``copy.deepcopy`` then take
the plain-tensor path and fail on the wrapper's missing storage ("invalid python storage").
:func:`shard_dtensor` builds the wrapper at offset 0, as DTensor builds the results of its own
ops, so torch saves, pickles and deep-copies it through its local tensor, which stays the view.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .layout import ParamLayout

if TYPE_CHECKING:
    from .tensor_parallel import TensorParallel

__all__ = ["ShardSpecs", "shard_dtensor"]


def shard_dtensor(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool = False) -> DTensor:
    """A DTensor with ``spec`` whose local tensor is ``local`` itself (a view stays a view;
    see the note above)."""
    meta = spec.tensor_meta
    assert meta is not None
    wrapper = torch.Tensor._make_wrapper_subclass(
        DTensor,
        meta.shape,
        strides=meta.stride,
        storage_offset=0,
        dtype=local.dtype,
        device=local.device,
        layout=local.layout,
        requires_grad=requires_grad,
    )
    wrapper._spec = spec
    wrapper._local_tensor = local
    return wrapper


class ShardSpecs:
    """Caches one ``DTensorSpec`` per (parameter, dtype) of a group.

    Every DTensor the group builds over its flat buffers (the sharded parameters, the main-grad
    views, the optimizer adapter's cast views) takes its spec from here, so a parameter and the
    fp32 grad the optimizer sees carry the very same spec object: DTensor's sharding-propagation
    cache compares specs by identity first and by a field-by-field ``__eq__`` (~0.6 µs) otherwise.

    Parameters that tensor parallelism placed (``tensor_parallel[i]`` not ``None``) take theirs
    from it: the global shape and the placements on the data- and tensor-parallel mesh.
    """

    def __init__(
        self,
        mesh: DeviceMesh,
        layouts: tuple[ParamLayout, ...],
        placements: tuple[Any, ...] = (),
        tensor_parallel: Sequence[TensorParallel | None] = (),
    ) -> None:
        self._mesh = mesh
        self._layouts = layouts
        self._placements = placements or (Shard(0),)
        self._tensor_parallel = tuple(tensor_parallel) or (None,) * len(layouts)
        self._specs: dict[torch.dtype, list[DTensorSpec]] = {}

    def specs(self, dtype: torch.dtype) -> list[DTensorSpec]:
        specs = self._specs.get(dtype)
        if specs is None:
            specs = [
                DTensorSpec(
                    self._mesh,
                    self._placements,
                    tensor_meta=TensorMeta(layout.global_shape, layout.global_stride, dtype),
                )
                if tp is None
                else tp.sharded_spec(dtype)
                for layout, tp in zip(self._layouts, self._tensor_parallel, strict=True)
            ]
            self._specs[dtype] = specs
        return specs
