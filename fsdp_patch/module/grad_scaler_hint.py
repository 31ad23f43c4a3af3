"""What to set when ``torch.amp.GradScaler`` meets fp16 main grads.

``GradScaler`` refuses fp16 gradients ("Attempting to unscale FP16 gradients."). With fp16
compute and the default policy, the main grads are fp16 although the parameters the user sees
are fp32 main weights, so torch's message points nowhere useful. The supported combination is
fp16 compute with ``MixedPrecisionPolicy(main_grads_dtype=torch.float32)``: fp32 main grads,
which ``GradScaler`` unscales and checks for infs as usual.

While a parameter group with fp16 main grads exists, ``GradScaler._unscale_grads_`` is wrapped
to add that advice to torch's error, for optimizers that hold such parameters only; once the
last such group is garbage collected the class attribute is restored exactly (unless someone
replaced it since, in which case ours stays and passes calls through).

Alternatives considered:
    - A warning at ``fully_shard``: fp16 main grads are valid without a ``GradScaler``
      (``precision_aware`` optimizers, manual loss scaling), so most warnings would be noise.
    - Refusing fp16 main grads: the same objection.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..torch_interop.scoped_patch import ScopedPatch

__all__ = ["track_fp16_main_grads", "ADVICE"]

ADVICE = (
    "fully_shard: this optimizer holds sharded parameters whose main grads are float16 (fp16 compute "
    "with the default MixedPrecisionPolicy). GradScaler needs fp32 grads: shard with "
    "fully_shard(..., mp_policy=MixedPrecisionPolicy(main_grads_dtype=torch.float32))."
)


def _with_advice(original: Any) -> Any:
    @functools.wraps(original)
    def _unscale_grads_(self: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, optimizer, *args, **kwargs)
        except ValueError as exc:
            if "FP16" not in str(exc) or not _holds_fp16_main_grads(optimizer):
                raise
            if hasattr(exc, "add_note"):  # Python >= 3.11: torch's error, with the advice as a note
                exc.add_note(ADVICE)
                raise
            raise ValueError(f"{exc} {ADVICE}") from exc

    return _unscale_grads_


_PATCH = ScopedPatch(lambda: torch.amp.GradScaler, "_unscale_grads_", _with_advice)


def track_fp16_main_grads(group: object) -> None:
    """Keeps the advice installed for as long as ``group`` (with fp16 main grads) lives."""
    _PATCH.hold(group)


def _holds_fp16_main_grads(optimizer: torch.optim.Optimizer) -> bool:
    from ..sharding import parameter_group_of

    for param_group in optimizer.param_groups:
        for param in param_group["params"]:
            group = parameter_group_of(param)
            if group is not None and group.grads_dtype == torch.float16:
                return True
    return False
