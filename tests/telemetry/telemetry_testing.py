"""Helpers shared by the telemetry tests and their spawned worker processes.

Kept out of conftest.py because the dist_pool ranks import them by module name.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from fsdp_patch.telemetry import semconv
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.test.globals_test import reset_metrics_globals, reset_trace_globals

from fsdp_patch.adapter.events import GroupCast, Mismatch, MismatchAction, Phase, StepPlanned


@dataclass
class ListGroup:
    """A stand-in for a torch FSDP2 group: a tensor per parameter, in a compute dtype cast at
    each gather."""

    main_weights: list[torch.Tensor]
    main_grads: list[torch.Tensor]
    compute_dtype: torch.dtype | None
    names: list[str]
    unit_name: str = "blocks.3"
    process_group: object = None


def reset_otel_globals() -> None:
    """Forget the global tracer and meter providers, so that the next test may install its own."""
    reset_trace_globals()
    reset_metrics_globals()


@dataclass
class Group:
    """A stand-in for fsdp_patch's ParameterGroup (satisfies telemetry.PrecisionView)."""

    main_weight: torch.Tensor
    compute_weight: torch.Tensor
    main_grad: torch.Tensor | None
    process_group: Any = None


@dataclass
class InMemoryTelemetry:
    """Providers whose output a test can read back."""

    tracer_provider: TracerProvider
    span_exporter: InMemorySpanExporter
    meter_provider: MeterProvider
    metric_reader: InMemoryMetricReader

    def spans(self) -> list[Any]:
        return list(self.span_exporter.get_finished_spans())

    def points(self) -> dict[str, list[Any]]:
        """Data points keyed by metric name (cumulative values since the start)."""
        return metric_points(self.metric_reader)


def in_memory_telemetry() -> InMemoryTelemetry:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    return InMemoryTelemetry(tracer_provider, exporter, meter_provider, reader)


def metric_points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    """The reader's data points by metric name (cumulative values since the start)."""
    data = reader.get_metrics_data()
    points: dict[str, list[Any]] = {}
    if data is None:
        return points
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                points.setdefault(metric.name, []).extend(metric.data.data_points)
    return points


def metric_values(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict[str, Any], Any]]]:
    """(attributes, value) per data point, by metric name; histograms give their count."""
    return {
        name: [(dict(p.attributes), p.count if isinstance(p, HistogramDataPoint) else p.value) for p in points]
        for name, points in metric_points(reader).items()
    }


def point_value(points: dict[str, list[Any]], name: str, **attributes: Any) -> Any:
    """The single data point of ``name`` whose attributes include ``attributes`` (value, or the point for histograms)."""
    wanted = dict(attributes)
    matches = [p for p in points.get(name, []) if all(p.attributes.get(k) == v for k, v in wanted.items())]
    assert len(matches) == 1, f"{name} {wanted}: {len(matches)} matching points in {points.get(name)}"
    point = matches[0]
    return point if isinstance(point, HistogramDataPoint) else point.value


def fake_optimizer(device: str = "cpu") -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(4, device=device))], lr=0.1)


def run_fake_step(
    observer: Any,
    groups: Sequence[Group],
    new_main: Sequence[torch.Tensor] | None = None,
    cast_bytes: int = 0,
    fail_in_inner_step: BaseException | None = None,
    params_count: int = 3,
) -> int:
    """Drive the observer exactly as fsdp_patch's adapter does for one step (telemetry on).

    The "optimizer step" writes ``new_main`` into each group's main weight and the refresh
    copies it into the compute weight with a real dtype cast.
    """
    with observer.step() as scope:
        mismatches = (Mismatch(torch.float32, torch.bfloat16, MismatchAction.CAST, 2),) if cast_bytes else ()
        observer.step_planned(StepPlanned(params_count, len(groups), mismatches))
        with observer.phase(Phase.CAST_GRADS):
            if cast_bytes:
                observer.grads_cast(GroupCast(torch.bfloat16, torch.float32, cast_bytes))
        due = observer.precision_due(scope.step_number)
        snapshot = observer.precision_begin(groups) if due else None
        try:
            with observer.phase(Phase.INNER_STEP):
                if fail_in_inner_step is not None:
                    raise fail_in_inner_step
                for group, value in zip(groups, new_main or (), strict=False):
                    group.main_weight.copy_(value)
        finally:
            with observer.phase(Phase.RESTORE_GRADS):
                pass
        with observer.phase(Phase.REFRESH):
            for group in groups:
                if group.compute_weight is not group.main_weight:
                    group.compute_weight.copy_(group.main_weight)
                    nbytes = group.compute_weight.numel() * group.compute_weight.element_size()
                    observer.weights_refreshed(GroupCast(group.main_weight.dtype, group.compute_weight.dtype, nbytes))
        if snapshot is not None:
            with observer.phase(Phase.PRECISION):
                observer.precision_end(snapshot, groups)
        return scope.step_number


def reference_stats(
    main_before: Sequence[np.ndarray],
    compute_before: Sequence[np.ndarray | None],
    main_after: Sequence[np.ndarray],
    compute_after: Sequence[np.ndarray | None],
    grads: Sequence[np.ndarray | None],
) -> dict[str, Any]:
    """The diagnostics of docs/conventions.md computed independently with numpy over all elements
    (norms over finite elements; amax float32's largest value once any grad is NaN/Inf, as
    telemetry.diagnostics.precision documents).

    ``compute_*`` None means the compute weight is the main weight. Arrays of all ranks may
    simply be concatenated per group before calling this.
    """

    def bits(a: np.ndarray) -> np.ndarray:
        return a.view({2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize])

    out: dict[str, Any] = {k: 0 for k in ("overflow", "underflow", "changed", "lost")}
    nonfinite = {(t, k): 0 for t in semconv.TENSORS for k in semconv.NONFINITE_KINDS}
    diff_sq = main_sq = 0.0
    amax = 0.0
    nonfinite_grad = False
    for mb, cb, ma, ca, g in zip(main_before, compute_before, main_after, compute_after, grads, strict=True):
        c = ma if ca is None else ca
        for name, arr in (
            (semconv.TENSOR_MAIN_WEIGHT, ma),
            (semconv.TENSOR_COMPUTE_WEIGHT, c),
            (semconv.TENSOR_MAIN_GRAD, g),
        ):
            if arr is None:
                continue
            nonfinite[(name, semconv.NONFINITE_NAN)] += int(np.isnan(arr).sum())
            nonfinite[(name, semconv.NONFINITE_INF)] += int(np.isinf(arr).sum())
        finite = np.isfinite(ma) & np.isfinite(c)
        m64 = ma.astype(np.float64)[finite]
        c64 = c.astype(np.float64)[finite]
        out["overflow"] += int((np.isfinite(ma) & np.isinf(c)).sum())
        out["underflow"] += int(((ma != 0) & (c == 0)).sum())
        diff_sq += float(np.sum((c64 - m64) ** 2))
        main_sq += float(np.sum(m64**2))
        changed = bits(ma) != bits(mb)
        # A compute weight that is the main weight changes exactly when the main weight does.
        kept = ~changed if ca is None else bits(ca) == bits(cb)
        out["changed"] += int(changed.sum())
        out["lost"] += int((changed & kept).sum())
        if g is not None:
            if not np.isfinite(g).all():
                nonfinite_grad = True
            elif g.size:
                amax = max(amax, float(np.abs(g.astype(np.float64)).max()))
    out["nonfinite"] = nonfinite
    out["refresh_error"] = math.sqrt(diff_sq / main_sq) if main_sq > 0 else 0.0
    out["lost_ratio"] = out["lost"] / out["changed"] if out["changed"] else 0.0
    out["grad_amax"] = float(np.finfo(np.float32).max) if nonfinite_grad else amax
    return out


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """numpy copy; bfloat16 goes through float32 (numpy has no bfloat16), fp16 stays fp16."""
    if t.dtype == torch.bfloat16:
        return t.float().numpy().copy()
    return t.detach().numpy().copy()


def _from_opentelemetry(log_filter: Any) -> bool:
    return type(log_filter).__module__.split(".", 1)[0] == "opentelemetry"


def global_state() -> dict[str, Any]:
    """Everything the package may install process-wide, by identity (``id``: a wrapt wrapper
    compares equal to what it wraps)."""
    import torch.distributed as dist
    import torch.nn.modules.module as module_hooks
    import torch.optim.optimizer as optimizer_module
    from torch.distributed import distributed_c10d as c10d
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    # OpenTelemetry's own modules add filters to their loggers when first imported (the SDK's
    # DuplicateFilter), and which of them a process has imported depends on what ran in it
    # before: those are left out, every other filter on an OpenTelemetry logger is counted.
    loggers = {
        n: [f for f in logging.getLogger(n).filters if not _from_opentelemetry(f)]
        for n in list(logging.root.manager.loggerDict)
        if n.split(".", 1)[0] == "opentelemetry"
    }
    return {
        "Optimizer.__init__": id(torch.optim.Optimizer.__dict__["__init__"]),
        "torch.autograd.backward": id(torch.autograd.backward),
        "global optimizer step pre-hooks": [id(h) for h in optimizer_module._global_optimizer_pre_hooks.values()],
        "dist.destroy_process_group": id(dist.destroy_process_group),
        "c10d.destroy_process_group": id(c10d.destroy_process_group),
        "opentelemetry logger filters": {n: [id(f) for f in fs] for n, fs in loggers.items() if fs},
        "global tracer provider": id(trace.get_tracer_provider()),
        "global meter provider": id(metrics.get_meter_provider()),
        "GradScaler.step": id(torch.amp.GradScaler.__dict__["step"]),
        "nn.utils.clip_grad_norm_": id(torch.nn.utils.clip_grad_norm_),
        "nn.utils.clip_grad.clip_grad_norm_": id(torch.nn.utils.clip_grad.clip_grad_norm_),
        "dispatch modes": [id(m) for m in _get_current_dispatch_mode_stack()],
        "global module forward hooks": [
            id(h)
            for hooks in (module_hooks._global_forward_pre_hooks, module_hooks._global_forward_hooks)
            for h in hooks.values()
        ],
    }
