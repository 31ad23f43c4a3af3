"""Every module of a model checked as it runs, while an adapted optimizer's telemetry is escalated.

Escalated (after a NaN/Inf, for ``FSDP_PATCH_PRECISION_ESCALATION`` iterations), a
:class:`~.model_watch.ModelWatch` checks every module of its model, not only its units
(:class:`ModuleChecks`): the first module whose output is not finite, with its dtype and largest
finite value, and the first module whose backward turned a finite output grad into a non-finite
input grad. Each check reads its tensor on the host (a sync per module): only while escalated.

Alternatives considered:
    - Full backward hooks (``register_full_backward_hook``) for the module-level backward checks:
      they rewrap a module's inputs and outputs, and an in-place operation on an output then
      raises inside the user's forward; tensor hooks only read.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from fsdp_patch.module.model_units import user_name

from .. import semconv
from ..diagnostics.origin import Origin
from ..diagnostics.probes import dtype_name, floating_tensors

__all__ = ["ModuleChecks"]


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def _finite_magnitude(t: torch.Tensor) -> float:
    finite = torch.isfinite(t)
    if not bool(finite.any()):
        return 0.0
    return float(t.detach()[finite].abs().max().double())


class ModuleChecks:
    """Every module of one model checked as it runs (one iteration of escalation at a time).

    Forward: the first module (children finish before their parent) whose output is not finite.
    Backward: the first module whose input grad is not finite while its output grad was.
    """

    def __init__(self, root: nn.Module, prefix: str = "") -> None:
        self.forward: Origin | None = None
        self.backward: Origin | None = None
        self._output_grad_finite: dict[str, bool] = {}
        self._handles = []
        for name, module in root.named_modules():
            name = user_name(prefix, name)
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._inputs, name)))
            self._handles.append(module.register_forward_hook(functools.partial(self._outputs, name)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def reset(self) -> tuple[Origin | None, Origin | None]:
        """What the iteration found (forward, backward); starts the next iteration."""
        found = (self.forward, self.backward)
        self.forward, self.backward = None, None
        self._output_grad_finite.clear()
        return found

    def _inputs(self, name: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not torch.is_grad_enabled():
            return
        for t in floating_tensors(args):
            if t.requires_grad:
                t.register_hook(functools.partial(self._input_grad, name))

    def _outputs(self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self.forward is None:
            for t in floating_tensors(output):
                if not _finite(t):
                    inputs = list(floating_tensors(args))
                    nan = bool(torch.isnan(t).any())
                    if not all(_finite(x) for x in inputs):
                        detail = "its input already held NaN/Inf, made by no module of the model (the batch, or code between modules in a parent's forward)"
                    else:
                        peak = max((_finite_magnitude(x) for x in inputs), default=0.0)
                        detail = (
                            f"largest finite |x| {_finite_magnitude(t):.6g} in the output, {peak:.6g} in its inputs; "
                            f"{dtype_name(t.dtype)} reaches {torch.finfo(t.dtype).max:.6g}"
                        )
                    self.forward = Origin(semconv.ORIGIN_FORWARD, name, dtype_name(t.dtype), nan, 0, detail)
                    break
        if torch.is_grad_enabled():
            for t in floating_tensors(output):
                if t.requires_grad:
                    t.register_hook(functools.partial(self._output_grad, name))

    def _output_grad(self, name: str, grad: torch.Tensor) -> None:
        finite = _finite(grad)
        self._output_grad_finite[name] = self._output_grad_finite.get(name, True) and finite

    def _input_grad(self, name: str, grad: torch.Tensor) -> None:
        if _finite(grad) or not self._output_grad_finite.get(name, False):
            return
        found = self.backward
        # A parent shares its first child's input: the hooks on that tensor run parent first, so
        # a module inside the one already named is the more precise answer.
        if found is None or name.startswith(found.where + ".") or found.where == "":
            nan = bool(torch.isnan(grad).any())
            self.backward = Origin(
                semconv.ORIGIN_BACKWARD,
                name,
                dtype_name(grad.dtype),
                nan,
                0,
                "finite grad of its output, non-finite grad of its input",
            )
