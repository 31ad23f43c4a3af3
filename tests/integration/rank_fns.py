"""Functions the telemetry integration tests run on every rank of a gloo pool.

Each function sets the environment it needs, installs in-memory OpenTelemetry providers as the
application's own (which the telemetry package must keep), trains a real sharded model through
the public API, and returns plain data (names, attributes, values, tensors detached).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from fsdp_patch.telemetry import semconv

from tests import models
from tests.telemetry.telemetry_testing import in_memory_telemetry, reset_otel_globals

STEPS = 3


@contextlib.contextmanager
def environment(**values: str | None) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _reset_otel() -> None:
    from fsdp_patch.telemetry.export import providers

    providers.reset()
    reset_otel_globals()


@contextlib.contextmanager
def in_memory_otel() -> Iterator[tuple[Any, Any]]:
    """Installs in-memory providers globally, as an application would; yields (spans, reader)."""
    from opentelemetry import metrics, trace

    _reset_otel()
    otel = in_memory_telemetry()
    trace.set_tracer_provider(otel.tracer_provider)
    metrics.set_meter_provider(otel.meter_provider)
    try:
        yield otel.span_exporter, otel.metric_reader
    finally:
        otel.tracer_provider.shutdown()
        otel.meter_provider.shutdown()
        _reset_otel()


def metric_points(reader: Any) -> dict[str, list[tuple[dict[str, Any], Any]]]:
    """(attributes, value) per data point, by metric name; histograms give their count."""
    out: dict[str, list[tuple[dict[str, Any], Any]]] = {}
    data = reader.get_metrics_data()
    for resource_metrics in data.resource_metrics if data else []:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                for point in metric.data.data_points:
                    value = point.count if hasattr(point, "bucket_counts") else point.value
                    out.setdefault(metric.name, []).append((dict(point.attributes), value))
    return out


def _bf16_model(seed: int = 0, compute_dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    model = models.make_model(seed).to(compute_dtype)
    return models.shard_model(model)


def _main_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    from fsdp_patch import parameter_groups

    return [g.main_weight.detach().clone() for g in parameter_groups(model)]


def _adamw_training() -> torch.nn.Module:
    """Trains the bf16 model STEPS steps with an adapted AdamW; returns the model."""
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _bf16_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fully_shard_optimizer(optimizer)
    for tokens in models.make_batches(STEPS):
        models.lm_loss(model, models.rank_slice(tokens, rank, world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def traced_training() -> dict[str, Any]:
    """Trains STEPS steps with telemetry on; returns spans, metric points and expected sizes."""
    from fsdp_patch import parameter_groups

    with environment(FSDP_PATCH_TELEMETRY="1", FSDP_PATCH_PRECISION_EVERY="0"), in_memory_otel() as (spans, reader):
        model = _adamw_training()
        finished = [
            {
                "name": s.name,
                "id": s.context.span_id,
                "parent": s.parent.span_id if s.parent else None,
                "attributes": dict(s.attributes),
                "status": s.status.status_code.name,
            }
            for s in spans.get_finished_spans()
        ]
        points = metric_points(reader)
    shapes = [p.shape for p in model.parameters()]
    compute_numel = sum(g.compute_weight.numel() for g in parameter_groups(model))
    return {
        "spans": finished,
        "points": points,
        "shapes": [tuple(s) for s in shapes],
        "compute_numel": compute_numel,
        "param_count": len(shapes),
        "fsdp_groups": len(parameter_groups(model)),
    }


def failing_step() -> dict[str, Any]:
    """A step whose closure raises; reports the span, the grads afterwards, and a next step."""
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world_size = dist.get_rank(), dist.get_world_size()
    with environment(FSDP_PATCH_TELEMETRY="1", FSDP_PATCH_PRECISION_EVERY="0"), in_memory_otel() as (spans, reader):
        model = _bf16_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        fully_shard_optimizer(optimizer)
        tokens = models.rank_slice(models.make_batches(1)[0], rank, world_size)
        models.lm_loss(model, tokens).backward()
        grads_before = [p.grad for p in model.parameters()]
        values_before = [g.to_local().clone() for g in grads_before]

        class Boom(RuntimeError):
            pass

        def closure() -> torch.Tensor:
            raise Boom("planted failure in the closure")

        raised = None
        try:
            optimizer.step(closure)
        except Boom as error:
            raised = str(error)
        after = list(model.parameters())
        same_objects = all(p.grad is g for p, g in zip(after, grads_before, strict=True))
        same_values = all(torch.equal(p.grad.to_local(), v) for p, v in zip(after, values_before, strict=True))
        dtypes = sorted({str(p.grad.dtype) for p in after} | {str(p.grad_dtype) for p in after})
        optimizer.step()  # the next step works
        step_spans = [
            {
                "status": s.status.status_code.name,
                "events": [e.name for e in s.events],
                "description": s.status.description,
            }
            for s in spans.get_finished_spans()
            if s.name == semconv.SPAN_STEP
        ]
    return {
        "raised": raised,
        "same_objects": same_objects,
        "same_values": same_values,
        "dtypes": dtypes,
        "step_spans": step_spans,
    }


def precision_run(scenario: str, diagnostics: bool, steps: int = 4) -> dict[str, Any]:
    """Trains with a planted bug; returns the precision metrics and the final main weights.

    Scenarios: ``nan`` (one NaN in rank 0's grad at step 2), ``overflow`` (fp16 compute weights;
    ``OVERFLOW_ELEMENTS`` main-weight elements per rank set past fp16's range at step 2),
    ``tiny_lr`` (lr 1e-7 on bf16 compute weights), ``normal_lr`` (lr 1e-3).
    """
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world_size = dist.get_rank(), dist.get_world_size()
    every = "1" if diagnostics else "0"
    compute_dtype = torch.float16 if scenario == "overflow" else torch.bfloat16
    lr = {"tiny_lr": 1e-7, "normal_lr": 1e-2}.get(scenario, 1e-3)
    # Adam moves every element with a grad by about lr, whatever the grad's scale, which makes
    # "too small for bf16" a property of lr alone.
    optimizer_class = torch.optim.Adam if scenario.endswith("_lr") else torch.optim.SGD
    with environment(FSDP_PATCH_TELEMETRY="1", FSDP_PATCH_PRECISION_EVERY=every), in_memory_otel() as (_, reader):
        model = _bf16_model(compute_dtype=compute_dtype)
        optimizer = optimizer_class(model.parameters(), lr=lr)
        fully_shard_optimizer(optimizer)
        for step, tokens in enumerate(models.make_batches(steps), start=1):
            models.lm_loss(model, models.rank_slice(tokens, rank, world_size)).backward()
            if step == 2 and scenario == "nan" and rank == 0:
                with torch.no_grad():
                    model.head.weight.grad.to_local().view(-1)[3] = float("nan")
            if step == 2 and scenario == "overflow":
                with torch.no_grad():
                    model.head.weight.to_local().view(-1)[:OVERFLOW_ELEMENTS] = 7.0e4
            optimizer.step()
            optimizer.zero_grad()
            if scenario in ("nan", "overflow") and step == 2:
                break  # later steps would only spread the planted values
        points = metric_points(reader)
    return {"points": points, "main": _main_weights(model)}


OVERFLOW_ELEMENTS = 5


def silent_training(patched: bool) -> list[torch.Tensor]:
    """Trains with FSDP_PATCH_TELEMETRY unset; with ``patched`` every OpenTelemetry entry point raises."""
    from unittest import mock

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("OpenTelemetry was called with FSDP_PATCH_TELEMETRY unset")

    targets = [
        "opentelemetry.trace.get_tracer",
        "opentelemetry.trace.get_tracer_provider",
        "opentelemetry.trace.get_current_span",
        "opentelemetry.trace.use_span",
        "opentelemetry.metrics.get_meter",
        "opentelemetry.metrics.get_meter_provider",
        "opentelemetry.context.attach",
        "opentelemetry.context.get_current",
        "opentelemetry.sdk.trace.Tracer.start_span",
        "opentelemetry.sdk.trace.Tracer.start_as_current_span",
        "fsdp_patch.telemetry.instrumentation.observer.OptimizerObserver.__init__",
    ]
    with contextlib.ExitStack() as stack, environment(FSDP_PATCH_TELEMETRY=None):
        if patched:
            for target in targets:
                stack.enter_context(mock.patch(target, forbidden))
        model = _adamw_training()
    return _main_weights(model)


def unreachable_collector(protocol: str) -> list[torch.Tensor]:
    """Trains with telemetry exporting over OTLP to a closed loopback port."""

    import fsdp_patch.telemetry as telemetry

    endpoint = "http://127.0.0.1:9" if protocol == "http/protobuf" else "127.0.0.1:9"
    _reset_otel()
    with environment(
        FSDP_PATCH_TELEMETRY="1",
        FSDP_PATCH_PRECISION_EVERY="1",
        FSDP_PATCH_FLUSH_TIMEOUT="2",
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_METRICS_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
        OTEL_EXPORTER_OTLP_TIMEOUT="1",
        OTEL_EXPORTER_OTLP_INSECURE="true",
        OTEL_BSP_SCHEDULE_DELAY="50",
        OTEL_METRIC_EXPORT_INTERVAL="100",
    ):
        model = _adamw_training()
        telemetry.shutdown()
    _reset_otel()
    return _main_weights(model)


def capped_trace_files(directory: str, steps: int, max_bytes: str) -> dict[str, Any]:
    """Trains ``steps`` steps on the embedded default trace files under a size cap; returns this rank's files."""
    import fsdp_patch.telemetry as telemetry

    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world_size = dist.get_rank(), dist.get_world_size()
    _reset_otel()
    settings = dict(
        FSDP_PATCH_TELEMETRY="1",
        FSDP_PATCH_PRECISION_EVERY="1",
        FSDP_PATCH_TRACE_DIR=directory,
        FSDP_PATCH_TRACE_MAX_BYTES=max_bytes,
        FSDP_PATCH_SUMMARY="none",
        OTEL_TRACES_EXPORTER=None,
        OTEL_METRICS_EXPORTER=None,
    )
    try:
        with environment(**settings):
            model = _bf16_model()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            fully_shard_optimizer(optimizer)
            batches = models.make_batches(4)
            for step in range(steps):
                tokens = batches[step % len(batches)]
                models.lm_loss(model, models.rank_slice(tokens, rank, world_size)).backward()
                optimizer.step()
                optimizer.zero_grad()
            telemetry.shutdown()
    finally:
        _reset_otel()
    names = sorted(n for n in os.listdir(directory) if n.startswith(f"rank{rank}."))
    return {"files": {n: os.path.getsize(os.path.join(directory, n)) for n in names}}
