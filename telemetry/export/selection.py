"""Which exporters ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` select: names -> classes.

A name means here what it means under ``opentelemetry-instrument``: the entry point of that name
in ``opentelemetry_traces_exporter`` / ``opentelemetry_metrics_exporter`` (the SDK's public
extension points, read with :func:`importlib.metadata.entry_points`), loaded and checked to be an
exporter of the signal (a ``SpanExporter``; a ``MetricExporter`` or a pull ``MetricReader``), and
``otlp`` the OTLP entry point of the protocol the specification's variables
``OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]PROTOCOL`` name (``grpc`` -> ``otlp_proto_grpc``,
``http/protobuf`` -> ``otlp_proto_http``). So ``console``, ``otlp``, ``prometheus``, this
package's ``trace_file`` and ``summary`` (registered in ``pyproject.toml``) and any installed
third-party exporter resolve to the same classes under both (``tests/telemetry/test_exporter_selection.py``
checks it against the SDK's configurator). Constructing them is
:mod:`fsdp_patch.telemetry.export.exporters`.

What the embedded default adds on top of that resolution:

- An unset or empty variable selects this package's default for the signal, which needs no
  server: ``trace_file`` for traces, ``summary`` for metrics (the SDK's configurator selects
  nothing). ``none`` anywhere in the list selects nothing for that entry; empty and repeated
  entries are skipped (the SDK's configurator stops at a ``none`` or an empty entry in a list).
- ``otlp`` with no protocol variable set for its signal is handed to the SDK as
  ``otlp_proto_http``: ``http/protobuf``, the OpenTelemetry specification's default (port 4318),
  where the SDK's configurator picks grpc. That is the one step before the SDK's resolution; once
  a protocol variable is set, the SDK resolves it, and a value it refuses is a warning naming the
  variable, the value and the accepted values.
- Each name is resolved and loaded on its own, and one that fails is a warning naming it and what
  to install or set, while the others are kept: the SDK raises for the whole list.

Alternatives considered:

- The SDK configurator's own resolution (``opentelemetry.sdk._configuration``'s
  ``_get_exporter_entry_point`` and ``_import_exporters``): the same meaning by construction, but
  private functions any SDK release may change or remove; what they do is the entry point lookup
  above and the specification's two protocol names.
- The SDK's ``_initialize_components`` wholesale: it installs the global tracer, meter and logger
  providers, which the embedded default must not do (an application may install its own at any
  time, and the API accepts only the first); it also raises for the whole list on one bad name.
- Our own class per name: a second meaning of each name, third-party exporters a special case,
  a new SDK exporter unknown until added here.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Literal

from .. import env

_logger = logging.getLogger(__name__)

Signal = Literal["traces", "metrics"]
TRACES_EXPORTER = "OTEL_TRACES_EXPORTER"
METRICS_EXPORTER = "OTEL_METRICS_EXPORTER"
TRACE_FILE = "trace_file"
SUMMARY = "summary"
VARIABLES: dict[Signal, str] = {"traces": TRACES_EXPORTER, "metrics": METRICS_EXPORTER}
DEFAULTS: dict[Signal, str] = {"traces": TRACE_FILE, "metrics": SUMMARY}
GROUPS: dict[Signal, str] = {"traces": "opentelemetry_traces_exporter", "metrics": "opentelemetry_metrics_exporter"}
DEFAULT_OTLP_PROTOCOL = "http/protobuf"  # the specification's default; the SDK's configurator picks grpc
# The http/protobuf exporters' entry point name, as opentelemetry-exporter-otlp-proto-http registers it.
_OTLP_HTTP_ENTRY_POINT = "otlp_proto_http"
_PROTOCOL_VARIABLES: dict[Signal, str] = {
    "traces": "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "metrics": "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
}
# What to install for an entry point that is not there: the extras of this package that bring it.
_EXTRAS = {"otlp_proto_http": "otlp", "otlp_proto_grpc": "otlp", "prometheus": "prometheus"}
# The OTLP protocols of the specification and the entry point each selects for ``otlp``.
OTLP_PROTOCOLS = {"grpc": "otlp_proto_grpc", DEFAULT_OTLP_PROTOCOL: _OTLP_HTTP_ENTRY_POINT}


@dataclass(frozen=True)
class Resolved:
    """One listed exporter name and what the SDK's configurator resolves it to.

    Attributes:
        name: The name as listed (``otlp``).
        entry_point: The entry point it resolved to (``otlp_proto_http``).
        exporter_class: The class that entry point loads.
    """

    name: str
    entry_point: str
    exporter_class: type


def listed_names(signal: Signal) -> list[str]:
    """The names ``OTEL_TRACES_EXPORTER``/``OTEL_METRICS_EXPORTER`` selects, before resolution.

    The signal's default (``trace_file``, ``summary``) when the variable is unset or empty; split at
    commas and stripped as the SDK's configurator splits it (names are case-sensitive, as entry
    points are); ``none`` (in any case), empty and repeated entries left out.
    """
    raw = os.environ.get(VARIABLES[signal], "")
    if not raw.strip():
        return [DEFAULTS[signal]]
    names: list[str] = []
    for name in raw.split(","):
        name = name.strip()
        if name and name.lower() != "none" and name not in names:
            names.append(name)
    return names


def installed_entry_points(group: str) -> list[EntryPoint]:
    """The installed entry points of ``group``, as the SDK's configurator finds them."""
    return list(entry_points(group=group))


def protocol_setting(signal: Signal) -> tuple[str, str] | None:
    """(variable, value) of the OTLP protocol the SDK reads for ``signal``, or ``None`` where none is set."""
    # The SDK's own precedence and test: the per-signal variable unless empty, then the general one.
    for variable in (_PROTOCOL_VARIABLES[signal], "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = os.environ.get(variable)
        if value:
            return variable, value
    return None


def _accepted(installed: list[EntryPoint]) -> list[str]:
    """The names that select something: the installed entry points, ``otlp`` where one serves it, ``none``."""
    names = {entry_point.name for entry_point in installed}
    if names & set(OTLP_PROTOCOLS.values()):
        names.add("otlp")
    return [*sorted(names), "none"]


def _not_installed(signal: Signal, name: str, entry_point: str, installed: list[EntryPoint]) -> None:
    group = GROUPS[signal]
    what = repr(name) if entry_point == name else f"{name!r} (the entry point {entry_point!r})"
    extra = _EXTRAS.get(entry_point)
    if extra is not None:
        hint = f"install it with `pip install 'fsdp-patch[{extra}]'`"
    else:
        hint = f"accepted values: {', '.join(_accepted(installed))}"
    _logger.warning(
        "%s lists %s, which is not an installed %s entry point; %s. fsdp_patch telemetry continues without it.",
        VARIABLES[signal],
        what,
        group,
        hint,
    )


def _entry_point_name(signal: Signal, name: str) -> str | None:
    """The entry point ``name`` selects (``otlp``: that of the protocol set, http/protobuf where none is); ``None``
    with a warning for a protocol the specification does not name."""
    if name != "otlp":
        return name
    setting = protocol_setting(signal)
    if setting is None:
        return _OTLP_HTTP_ENTRY_POINT
    variable, value = setting
    entry_point = OTLP_PROTOCOLS.get(value.strip())
    if entry_point is None:
        _logger.warning(
            "%s=%r is not valid; accepted values: %s. fsdp_patch telemetry continues without the OTLP %s exporter "
            "(%s lists %r).",
            variable,
            value,
            ", ".join(sorted(OTLP_PROTOCOLS)),
            signal,
            VARIABLES[signal],
            name,
        )
    return entry_point


def _is_exporter_of(signal: Signal, cls: object) -> bool:
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricReader
    from opentelemetry.sdk.trace.export import SpanExporter

    wanted: tuple[type, ...] = (SpanExporter,) if signal == "traces" else (MetricExporter, MetricReader)
    return isinstance(cls, type) and issubclass(cls, wanted)


def _resolve_one(signal: Signal, name: str, installed: list[EntryPoint]) -> Resolved | None:
    entry_point = _entry_point_name(signal, name)
    if entry_point is None:
        return None
    matching = [ep for ep in installed if ep.name == entry_point]
    if not matching:
        _not_installed(signal, name, entry_point, installed)
        return None
    try:
        exporter_class = matching[0].load()
        if not _is_exporter_of(signal, exporter_class):
            kind = "a trace exporter" if signal == "traces" else "a metric exporter or reader"
            raise TypeError(f"{exporter_class!r} is not {kind}")
    except Exception as exc:  # its module does not import, or it is not an exporter of this signal
        extra = _EXTRAS.get(entry_point)
        hint = f"; `pip install 'fsdp-patch[{extra}]'` installs what it needs" if extra else ""
        _logger.warning(
            "fsdp_patch telemetry: %s lists %r, whose %s entry point %r could not be loaded (%s: %s)%s; continuing "
            "without it.",
            VARIABLES[signal],
            name,
            GROUPS[signal],
            entry_point,
            type(exc).__name__,
            exc,
            hint,
        )
        return None
    return Resolved(name, entry_point, exporter_class)


def resolve(signal: Signal) -> list[Resolved]:
    """The exporters the variable of ``signal`` selects, resolved name by name.

    A name that does not resolve or load is a warning, and left out; the others are kept.
    """
    names = listed_names(signal)
    if not names:
        return []
    installed = installed_entry_points(GROUPS[signal])
    found: list[Resolved] = []
    for name in names:
        resolved = _resolve_one(signal, name, installed)
        # Two names of one entry point (otlp, otlp_proto_http) are one exporter, as for the SDK's configurator.
        if resolved is not None and all(r.entry_point != resolved.entry_point for r in found):
            found.append(resolved)
    return found


def trace_files_off_reason(world_size: int = 1) -> str | None:
    """Why this job's ranks write no trace files, or ``None`` when they do (the precision report reads them).

    Args:
        world_size: Ranks of the job, to tell whether ``FSDP_PATCH_TRACE_RANKS`` leaves any traced.
    """
    if env.sdk_disabled():
        return "OTEL_SDK_DISABLED=true turns telemetry off, so no trace files were written"
    names = listed_names("traces")
    if TRACE_FILE not in names:
        listed = os.environ.get(TRACES_EXPORTER, "").strip()
        keep = ",".join([*names, TRACE_FILE])
        return (
            f"{TRACES_EXPORTER}={listed} does not list {TRACE_FILE}, so no trace files were written; to keep them "
            f"(and this report) beside any other exporter, set {TRACES_EXPORTER}={keep}"
        )
    try:
        ranks = env.trace_ranks()
    except ValueError:
        return None  # reported when the optimizer was adapted
    if ranks is not None and not ranks & set(range(world_size)):
        return (
            f"{env.TRACE_RANKS}={os.environ.get(env.TRACE_RANKS, '').strip()} traces none of ranks 0-{world_size - 1}"
        )
    return None
