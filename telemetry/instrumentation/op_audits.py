"""When the operation audit runs, and what it says: one adapted optimizer's audited iterations.

:class:`~.iterations.IterationWatch` owns one :class:`OperationAudits`. An audited iteration is
everything from the end of one optimizer step to the end of the next: what the script does between
steps, the forward, the loss, the backward and the optimizer's step (:mod:`..diagnostics.op_audit`
measures it; fsdp_patch's and torch.distributed's own operations are left out). The second
iteration is audited (the first steady one), then every ``FSDP_PATCH_PRECISION_AUDIT_EVERY``-th,
and every escalated one, so that a NaN/Inf the per-iteration checks saw begin is named down to its
operation in the next iteration that repeats it. The findings go on the span of the step that ends
the iteration as events ``fsdp.precision.op``, at most ``FSDP_PATCH_PRECISION_TOP_K`` of each kind
per iteration, each (kind, operation, line, phase) once per run.

One audit runs at a time in a process: a second optimizer's iteration that falls due while another's
runs is not audited. A model with ``torch.compile``d modules is not audited: under a dispatch mode
its compiled code would run eagerly, and train differently.

Process-wide while an audited iteration runs: a dispatch mode on the main thread's mode stack and
two global module forward hooks, all removed, exactly, when it ends, and by :meth:`close` (telemetry
turned off, a flush or exit, the optimizer collected). An iteration whose step never comes (the
last step of a run was followed by an audited iteration's start) stays audited until then, at most
20,000 operations, after which it passes every operation through.
"""

from __future__ import annotations

import logging

import torch
from opentelemetry.trace import Span
from opentelemetry.util.types import AttributeValue
from torch import nn

from fsdp_patch.module.model_units import sharded_models, user_name

from .. import env, semconv
from ..diagnostics.op_audit import OpAudit
from ..diagnostics.op_judgement import OpFinding

__all__ = ["OperationAudits", "abandon_running", "compiled"]

_logger = logging.getLogger(__name__)

# The audit running in this process, if any (a dispatch mode is process-wide on its thread).
_RUNNING: list[OpAudit] = []


def compiled(root: nn.Module) -> bool:
    """Whether ``root`` holds a ``torch.compile``d module: under a dispatch mode or a shadow its
    compiled code would run eagerly, and train differently."""
    return any(
        type(module).__name__ == "OptimizedModule" or getattr(module, "_compiled_call_impl", None) is not None
        for module in root.modules()
    )


class OperationAudits:
    """The audited iterations of one optimizer (see the module).

    Args:
        optimizer: The adapted optimizer (its parameters find the models to name modules by).
        every: The audit's interval (``0``: off).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, every: int) -> None:
        self.every = every
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        self._audit: OpAudit | None = None
        self._named: set[tuple[str, str, str, str]] = set()
        self._top_k = max(env.precision_top_k(), 1)

    @classmethod
    def from_environment(cls, optimizer: torch.optim.Optimizer, diagnostics_on: bool) -> OperationAudits:
        return cls(optimizer, env.precision_audit_every() if diagnostics_on else 0)

    def due(self, iteration: int, escalated: bool) -> bool:
        """Whether iteration ``iteration`` (the one step ``iteration`` ends) is audited."""
        if self.every <= 0:
            return False
        return escalated or iteration == 2 or iteration % self.every == 0

    @property
    def running(self) -> bool:
        return self._audit is not None

    def start(self) -> None:
        """Begin auditing the iteration that starts now, unless another audit runs."""
        if self._audit is not None or _RUNNING:
            return
        names: dict[int, str] = {}
        for model in sharded_models(self._params):
            if compiled(model.root):
                return
            for name, module in model.root.named_modules():
                names.setdefault(id(module), user_name(model.prefix, name))
        audit = OpAudit(names)
        audit.start()
        _RUNNING.append(audit)
        self._audit = audit

    def optimizer_step(self, running: bool) -> None:
        """The optimizer's step begins (``True``) or has ended (``False``)."""
        if self._audit is not None:
            self._audit.in_optimizer = running
            self._audit.stepped = self._audit.stepped or not running

    def finish(self, step: int, span: Span | None, rank: int) -> list[OpFinding]:
        """End the running audit: its findings go on ``span`` (that of step ``step``)."""
        audit, self._audit = self._audit, None
        if audit is None:
            return []
        _forget(audit)
        findings = audit.finish(self._top_k)
        if audit.failed:
            _logger.debug("operation audit: the reference could not run %s", audit.failed)
        fresh = [f for f in findings if f.key not in self._named]
        self._named.update(f.key for f in fresh)
        if span is not None:
            for finding in fresh:
                span.add_event(semconv.EVENT_OP, event_attributes(finding, step, rank))
        return fresh

    def close(self) -> None:
        """Stop a running audit without reading it (telemetry turned off, the optimizer gone)."""
        audit, self._audit = self._audit, None
        if audit is not None:
            _forget(audit)
            audit.stop()


def _forget(audit: OpAudit) -> None:
    if audit in _RUNNING:
        _RUNNING.remove(audit)


def abandon_running() -> int:
    """Stop every audit running in this process without reading it (what a run that stops in the
    middle of an audited iteration leaves); returns how many there were. Their owners forget them
    at their next step."""
    running = list(_RUNNING)
    _RUNNING.clear()
    for audit in running:
        audit.stop()
    return len(running)


def event_attributes(finding: OpFinding, step: int, rank: int) -> dict[str, AttributeValue]:
    """The attributes of one ``fsdp.precision.op`` event."""
    site = finding.site
    attrs: dict[str, AttributeValue] = {
        semconv.ATTR_STEP: step,
        semconv.ATTR_RANK: rank,
        semconv.ATTR_OP_KIND: finding.kind,
        semconv.ATTR_OP_NAME: finding.op,
        semconv.ATTR_OP_DTYPE: finding.dtype,
        semconv.ATTR_OP_PHASE: finding.phase,
        semconv.ATTR_OP_SITE: site.where if site.file else "",
        semconv.ATTR_OP_CALLER: site.caller,
        semconv.ATTR_OP_DETAIL: finding.detail,
        semconv.ATTR_OP_FIX: finding.fix,
        semconv.ATTR_OP_SHARE: finding.share,
        semconv.ATTR_OP_ORDER: finding.order,
    }
    if site.module is not None:
        attrs[semconv.ATTR_OP_MODULE] = site.module
    elif site.module_type:
        attrs[semconv.ATTR_OP_MODULE] = f"<{site.module_type}>"
    if finding.kind == semconv.OP_KIND_NONFINITE:
        attrs[semconv.ATTR_OP_FP32_FINITE] = finding.fp32_finite
    return attrs
