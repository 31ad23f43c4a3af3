"""In-memory OpenTelemetry and a small sharded training for the integration tests' rank bodies.

``in_memory_otel`` installs in-memory providers as the application's own (which the telemetry
package must keep); ``environment`` sets variables for one block; ``metric_values`` (re-exported
from the telemetry tests' helpers) reads a reader's points by metric name; ``adamw_training`` trains the bf16 model ``STEPS`` steps through
the public API.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from tests import models
from tests.telemetry.telemetry_testing import in_memory_telemetry, metric_values, reset_otel_globals

STEPS = 3
__all__ = [
    "STEPS",
    "adamw_training",
    "environment",
    "in_memory_otel",
    "main_weights",
    "metric_values",
    "reset_otel",
]


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


def reset_otel() -> None:
    from fsdp_patch.telemetry.export import providers

    providers.reset()
    reset_otel_globals()


@contextlib.contextmanager
def in_memory_otel() -> Iterator[tuple[Any, Any]]:
    """Installs in-memory providers globally, as an application would; yields (spans, reader)."""
    from opentelemetry import metrics, trace

    reset_otel()
    otel = in_memory_telemetry()
    trace.set_tracer_provider(otel.tracer_provider)
    metrics.set_meter_provider(otel.meter_provider)
    try:
        yield otel.span_exporter, otel.metric_reader
    finally:
        otel.tracer_provider.shutdown()
        otel.meter_provider.shutdown()
        reset_otel()


def main_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    from fsdp_patch import parameter_groups

    return [g.main_weight.detach().clone() for g in parameter_groups(model)]


def adamw_training() -> torch.nn.Module:
    """Trains the bf16 model STEPS steps with an adapted AdamW; returns the model."""
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = models.sharded_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fully_shard_optimizer(optimizer)
    for tokens in models.make_batches(STEPS):
        models.lm_loss(model, models.rank_slice(tokens, rank, world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model
