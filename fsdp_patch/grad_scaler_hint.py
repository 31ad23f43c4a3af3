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
import threading
import weakref
from typing import Any

import torch

__all__ = ["track_fp16_main_grads", "ADVICE"]

ADVICE = (
    "fully_shard: this optimizer holds sharded parameters whose main grads are float16 (fp16 compute "
    "with the default MixedPrecisionPolicy). GradScaler needs fp32 grads: shard with "
    "fully_shard(..., mp_policy=MixedPrecisionPolicy(main_grads_dtype=torch.float32))."
)

_lock = threading.Lock()
_live = 0
_original: Any = None
_wrapper: Any = None


def track_fp16_main_grads(group: object) -> None:
    """Keeps the advice installed for as long as ``group`` (with fp16 main grads) lives."""
    global _live
    with _lock:
        _live += 1
        if _live == 1:
            _install()
    weakref.finalize(group, _release)


def _release() -> None:
    global _live
    with _lock:
        _live -= 1
        if _live == 0:
            _uninstall()


def _install() -> None:
    global _original, _wrapper
    scaler = torch.amp.GradScaler
    original = scaler.__dict__["_unscale_grads_"]

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

    _original, _wrapper = original, _unscale_grads_
    scaler._unscale_grads_ = _unscale_grads_  # type: ignore[method-assign]


def _uninstall() -> None:
    global _original, _wrapper
    scaler = torch.amp.GradScaler
    if scaler.__dict__.get("_unscale_grads_") is _wrapper:
        scaler._unscale_grads_ = _original  # type: ignore[method-assign]
        _original = _wrapper = None


def _holds_fp16_main_grads(optimizer: torch.optim.Optimizer) -> bool:
    from .sharding import parameter_group_of

    for param_group in optimizer.param_groups:
        for param in param_group["params"]:
            group = parameter_group_of(param)
            if group is not None and group.grads_dtype == torch.float16:
                return True
    return False
