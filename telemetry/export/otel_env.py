"""The standard ``OTEL_*`` variables that shape the SDK objects this package builds, read leniently.

The SDK raises ``ValueError`` from its constructors for some malformed values
(``OTEL_BSP_MAX_QUEUE_SIZE=-1``, ``OTEL_METRIC_EXPORT_INTERVAL=-1``, a negative span limit),
which would escape from the first ``optimizer.step()``. These are not ours to reject: each
variable is parsed here by the specification's rules, a malformed value is warned about once per value
(naming the variable, the value, the accepted values and the default used) and replaced by the
SDK's default, and the SDK objects get the values as explicit arguments.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from .isolation import WarnOnce

_logger = logging.getLogger(__name__)
_warn = WarnOnce(_logger)

# variable -> (constructor argument, SDK default, accepts 0)
_BATCH = {
    "OTEL_BSP_SCHEDULE_DELAY": ("schedule_delay_millis", 5000.0, False),
    "OTEL_BSP_MAX_QUEUE_SIZE": ("max_queue_size", 2048, False),
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": ("max_export_batch_size", 512, False),
    "OTEL_BSP_EXPORT_TIMEOUT": ("export_timeout_millis", 30000.0, True),
}
_READER = {
    "OTEL_METRIC_EXPORT_INTERVAL": ("export_interval_millis", 60000.0, False),
    "OTEL_METRIC_EXPORT_TIMEOUT": ("export_timeout_millis", 30000.0, True),
}
# Span limits: non-negative integers; a malformed one falls back to the SDK's default (None: unset).
_SPAN_LIMITS = {
    "OTEL_ATTRIBUTE_COUNT_LIMIT": ("max_attributes", 128),
    "OTEL_SPAN_EVENT_COUNT_LIMIT": ("max_events", 128),
    "OTEL_SPAN_LINK_COUNT_LIMIT": ("max_links", 128),
    "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": ("max_span_attributes", 128),
    "OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT": ("max_event_attributes", 128),
    "OTEL_LINK_ATTRIBUTE_COUNT_LIMIT": ("max_link_attributes", 128),
    "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": ("max_attribute_length", None),
    "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT": ("max_span_attribute_length", None),
}


def _number(variable: str, default: Any, zero_ok: bool, kind: Callable[[str], Any], accepted: str) -> Any:
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
        if value < 0 or (value == 0 and not zero_ok) or value != value or value == float("inf"):
            raise ValueError(raw)
    except ValueError:
        _warn(
            f"{variable}={raw!r}",
            "%s=%r is not valid; accepted values: %s. fsdp_patch telemetry uses the default, %s.",
            variable,
            raw,
            accepted,
            default,
        )
        return default
    return value


def _table(table: dict[str, tuple[str, Any, bool]]) -> dict[str, Any]:
    out = {}
    for variable, (argument, default, zero_ok) in table.items():
        kind: type[int] | type[float]
        if isinstance(default, int):
            kind, accepted = int, "a positive integer"
        else:
            kind, accepted = float, "a non-negative number" if zero_ok else "a positive number"
        out[argument] = _number(variable, default, zero_ok, kind, accepted)
    return out


def batch_processor_arguments() -> dict[str, Any]:
    """``BatchSpanProcessor`` keyword arguments from ``OTEL_BSP_*``; never raises."""
    args = _table(_BATCH)
    if args["max_export_batch_size"] > args["max_queue_size"]:
        default = min(_BATCH["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"][1], args["max_queue_size"])
        _warn(
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE=%r is not valid; accepted values: a "
            "positive integer at most the queue size (%d). fsdp_patch telemetry uses the default, %d.",
            str(args["max_export_batch_size"]),
            args["max_queue_size"],
            default,
        )
        args["max_export_batch_size"] = default
    return args


def metric_reader_arguments() -> dict[str, Any]:
    """``PeriodicExportingMetricReader`` keyword arguments from ``OTEL_METRIC_EXPORT_*``; never raises."""
    return _table(_READER)


def span_limits() -> Any:
    """``SpanLimits`` from the ``OTEL_*_LIMIT`` variables, malformed ones replaced by the SDK's defaults."""
    from opentelemetry.sdk.trace import SpanLimits

    args: dict[str, Any] = {}
    for variable, (argument, default) in _SPAN_LIMITS.items():
        raw = os.environ.get(variable, "").strip()
        if not raw:
            continue
        try:
            if int(raw) < 0:
                raise ValueError(raw)
        except ValueError:
            _warn(
                f"{variable}={raw!r}",
                "%s=%r is not valid; accepted values: a non-negative integer. fsdp_patch telemetry uses "
                "the default, %s.",
                variable,
                raw,
                "no limit" if default is None else default,
            )
            args[argument] = SpanLimits.UNSET if default is None else default
    return SpanLimits(**args)


def check_sdk_disabled() -> None:
    """Warn once about an ``OTEL_SDK_DISABLED`` that is neither ``true`` nor ``false``.

    The specification reads any other value as false and asks for a warning: a typo such as
    ``maybe`` or ``yes`` must not leave telemetry on without a word.
    """
    raw = os.environ.get("OTEL_SDK_DISABLED", "").strip()
    if raw.lower() not in ("", "true", "false"):
        _warn(
            f"OTEL_SDK_DISABLED={raw!r}",
            "OTEL_SDK_DISABLED=%r is not valid; accepted values: true, false. It reads as false "
            "(the OpenTelemetry specification's rule): fsdp_patch telemetry stays on.",
            raw,
        )


def check_service_name(used: object) -> None:
    """Warn once when ``OTEL_SERVICE_NAME`` is set but blank: the service is then named ``used``, not what was meant."""
    raw = os.environ.get("OTEL_SERVICE_NAME")
    if raw is not None and not raw.strip():
        _warn(
            f"OTEL_SERVICE_NAME={raw!r} -> {used!r}",
            "OTEL_SERVICE_NAME is set but empty; accepted values: a non-empty name. "
            "fsdp_patch telemetry names the service %r instead.",
            used,
        )
