"""Mixed-precision policy of the minimal Megatron-FSDP path, which also takes FSDP2's arguments."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

__all__ = ["MixedPrecisionPolicy", "COMPUTE_COPY_LIFETIMES", "as_policy"]

COMPUTE_COPY_LIFETIMES = ("persistent", "per_gather")
_DTYPE_FIELDS = ("main_params_dtype", "main_grads_dtype", "param_dtype", "output_dtype")


class MixedPrecisionPolicy:
    """Dtypes of the sharded copies that ``fully_shard`` keeps per parameter, and of what flows
    in and out of a unit's forward.

    Takes FSDP2's arguments under FSDP2's names, with FSDP2's meaning, so that a script moves
    from ``torch.distributed.fsdp`` by changing its import: ``param_dtype`` is the compute dtype,
    ``reduce_dtype`` the main-grad dtype (``main_grads_dtype`` is the same setting under
    Megatron-FSDP's name), ``output_dtype`` and ``cast_forward_inputs`` as FSDP2's. Keyword
    arguments only: FSDP2's positional order (``param_dtype, reduce_dtype, ...``) would read here
    as other settings.

    Attributes:
        main_params_dtype: Dtype of the sharded main weights the optimizer updates.
        main_grads_dtype: Dtype of the sharded main gradients (and of the reduce-scatter),
            advertised on each sharded parameter through ``Tensor.grad_dtype``. ``None`` means
            the compute dtype. ``reduce_dtype`` reads the same value.
        param_dtype: The compute dtype: of the all-gathered parameters that forward and backward
            use. ``None`` means each parameter's own dtype when ``fully_shard`` is applied (a
            model converted with ``model.bfloat16()`` beforehand computes in bf16; its main
            weights then start from the bf16 values).
        output_dtype: Floating-point tensors in the unit's forward output are cast to it;
            ``None`` leaves them as computed.
        cast_forward_inputs: With ``param_dtype`` set, floating-point tensors in the unit's
            forward arguments are cast to it.
        compute_copy: Lifetime of the sharded compute-dtype copy that all-gathers read (when
            the compute dtype differs from ``main_params_dtype``):

            - ``"persistent"`` (the default, Megatron-FSDP's): it lives as long as the model;
              the optimizer adapter refreshes it right after each step, where telemetry times
              the refresh and counts its bytes, and each iteration's first all-gather casts it
              again (so that writes to the main weights made outside the adapter reach the
              forward); backward's re-gathers read it without a cast.
              It costs ``itemsize(compute dtype)`` bytes per sharded element that FSDP2 does
              not hold (2 of bf16: 14 bytes per element between AdamW steps against 12).
            - ``"per_gather"``: each all-gather casts the main weights into a copy that is
              freed once the all-gather completes, as FSDP2 casts into its all-gather input;
              the adapter's refresh only marks the weights changed. Memory as FSDP2's at
              every moment, and one cast per all-gather.

    Alternatives considered:
        - Only the persistent copy: it holds 2 bytes per element that FSDP2 does not, between
          steps and through forward and backward, which no buffer management wins back.
        - A copy kept for one iteration (cast by the first all-gather after a step, freed by
          the backward with gradient sync): between steps it matches FSDP2, but it is alive
          at the start of backward, where activations peak, and through accumulation
          microbatches, so the peaks stay above FSDP2's (measured: +1% with 1 microbatch,
          +7% with 4, on the main job's model).
        - Only a per-gather copy: the refresh telemetry (duration, bytes, the precision
          checks at the moment of the refresh) would have nothing to time at the step.
        - Separate policies for FSDP2's names and Megatron-FSDP's: a migrating script would
          have to rewrite its policy; one class taking both keeps the migration one import.
    """

    __slots__ = (
        "main_params_dtype",
        "main_grads_dtype",
        "param_dtype",
        "output_dtype",
        "cast_forward_inputs",
        "compute_copy",
    )

    main_params_dtype: torch.dtype
    main_grads_dtype: torch.dtype | None
    param_dtype: torch.dtype | None
    output_dtype: torch.dtype | None
    cast_forward_inputs: bool
    compute_copy: Literal["persistent", "per_gather"]

    def __init__(
        self,
        *args: Any,
        main_params_dtype: torch.dtype = torch.float32,
        main_grads_dtype: torch.dtype | None = None,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        output_dtype: torch.dtype | None = None,
        cast_forward_inputs: bool = True,
        compute_copy: Literal["persistent", "per_gather"] = "persistent",
    ) -> None:
        if args:
            raise TypeError(
                f"MixedPrecisionPolicy takes keyword arguments only (param_dtype=..., reduce_dtype=..., "
                f"output_dtype=..., cast_forward_inputs=..., main_params_dtype=..., main_grads_dtype=..., "
                f"compute_copy=...), got {len(args)} positional: {args!r}"
            )
        if main_grads_dtype is not None and reduce_dtype is not None and main_grads_dtype != reduce_dtype:
            raise ValueError(
                "MixedPrecisionPolicy: reduce_dtype (FSDP2's name) and main_grads_dtype name one setting, the "
                f"dtype grads are reduced and kept in; got reduce_dtype={reduce_dtype} and "
                f"main_grads_dtype={main_grads_dtype}: give one"
            )
        if compute_copy not in COMPUTE_COPY_LIFETIMES:
            raise ValueError(
                f"MixedPrecisionPolicy.compute_copy must be one of {', '.join(map(repr, COMPUTE_COPY_LIFETIMES))}, "
                f"got {compute_copy!r}"
            )
        if not isinstance(cast_forward_inputs, bool):
            raise TypeError(f"MixedPrecisionPolicy.cast_forward_inputs must be a bool, got {cast_forward_inputs!r}")
        values = {
            "main_params_dtype": main_params_dtype,
            "main_grads_dtype": main_grads_dtype if main_grads_dtype is not None else reduce_dtype,
            "param_dtype": param_dtype,
            "output_dtype": output_dtype,
        }
        for name, value in values.items():
            if value is None and name != "main_params_dtype":
                continue
            if not isinstance(value, torch.dtype) or not value.is_floating_point:
                shown = "reduce_dtype" if name == "main_grads_dtype" and main_grads_dtype is None else name
                raise TypeError(f"MixedPrecisionPolicy.{shown} must be a floating-point torch.dtype, got {value!r}")
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "cast_forward_inputs", cast_forward_inputs)
        object.__setattr__(self, "compute_copy", compute_copy)

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """FSDP2's name for :attr:`main_grads_dtype`."""
        return self.main_grads_dtype

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"MixedPrecisionPolicy is immutable; build a new one to change {name}")

    def _key(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MixedPrecisionPolicy) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"MixedPrecisionPolicy({fields})"

    def __reduce__(self) -> tuple:
        return (_rebuild, (self._kwargs(),))

    def _kwargs(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    def compute_dtype_for(self, param_dtype: torch.dtype) -> torch.dtype:
        """Compute dtype of a parameter whose own dtype is ``param_dtype``."""
        return self.param_dtype if self.param_dtype is not None else param_dtype

    def grads_dtype_for(self, compute_dtype: torch.dtype) -> torch.dtype:
        """Main-grad dtype for parameters whose compute dtype is ``compute_dtype``."""
        return self.main_grads_dtype if self.main_grads_dtype is not None else compute_dtype


def _rebuild(kwargs: dict[str, Any]) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(**kwargs)


def as_policy(policy: Any) -> MixedPrecisionPolicy:
    """``policy`` as this package's policy: ``None`` is the default; torch FSDP2's
    ``MixedPrecisionPolicy`` maps field for field (``param_dtype``, ``reduce_dtype``,
    ``output_dtype``, ``cast_forward_inputs``), main weights in float32.

    Raises:
        TypeError: ``policy`` is neither.
    """
    if policy is None:
        return MixedPrecisionPolicy()
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    if isinstance(policy, TorchPolicy):
        mapped = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
        extra = [
            f.name for f in dataclasses.fields(policy) if f.name not in mapped and getattr(policy, f.name) != f.default
        ]
        if extra:
            raise ValueError(
                f"fully_shard: torch FSDP2's MixedPrecisionPolicy sets {extra}, which fully_shard does "
                "not implement; it maps param_dtype, reduce_dtype, output_dtype and cast_forward_inputs"
            )
        return MixedPrecisionPolicy(
            param_dtype=policy.param_dtype,
            reduce_dtype=policy.reduce_dtype,
            output_dtype=policy.output_dtype,
            cast_forward_inputs=policy.cast_forward_inputs,
        )
    raise TypeError(
        "fully_shard expected mp_policy to be a MixedPrecisionPolicy (fsdp_patch's, or torch FSDP2's) or None, "
        f"got {type(policy)!r}"
    )
