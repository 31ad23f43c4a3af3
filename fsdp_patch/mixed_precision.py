"""Mixed-precision policy of the minimal Megatron-FSDP path."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the sharded copies that ``fully_shard`` keeps per parameter.

    The compute dtype is not part of the policy: it is the module's own parameter dtype, so a
    user who wants bf16 compute calls ``model.bfloat16()`` before ``fully_shard``.

    Attributes:
        main_params_dtype: Dtype of the sharded main weights the optimizer updates.
        main_grads_dtype: Dtype of the sharded main gradients, advertised on each sharded
            parameter through ``Tensor.grad_dtype``. ``None`` means the compute dtype.
    """

    main_params_dtype: torch.dtype = torch.float32
    main_grads_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("main_params_dtype", "main_grads_dtype"):
            value = getattr(self, name)
            if value is None and name == "main_grads_dtype":
                continue
            if not isinstance(value, torch.dtype) or not value.is_floating_point:
                raise TypeError(
                    f"MixedPrecisionPolicy.{name} must be a floating-point torch.dtype, "
                    f"got {value!r}"
                )

    def grads_dtype_for(self, compute_dtype: torch.dtype) -> torch.dtype:
        """Main-grad dtype for parameters whose compute dtype is ``compute_dtype``."""
        return self.main_grads_dtype if self.main_grads_dtype is not None else compute_dtype
