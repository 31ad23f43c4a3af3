"""Helpers for the dashboards/ tests (fixtures are in conftest.py).

The Prometheus names the dashboards may use are not written down here: they are read off the real
OpenTelemetry Prometheus exporter (opentelemetry-exporter-prometheus + prometheus_client), after
creating every instrument of the telemetry package's table (telemetry.instrumentation.instruments, the metrics of
docs/conventions.md) with its own create_instruments() on an SDK MeterProvider, and recording a
point for every combination of the attribute values the page lists, once per rank, the way a job
of two ranks exposes them on its pull endpoints (port 9464 + local_rank).
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from fsdp_patch.telemetry import semconv

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "dashboards"
# The Grafana dashboard and the folder Grafana's provisioning reads.
MAIN_DASHBOARD = "fsdp_optimizer.json"
PROVISIONED = DASHBOARDS / "grafana" / "provisioning"
INSTALL_PROMTOOL = "dashboards/install_promtool.sh"

RANKS = ("0", "1")
WORLD_SIZE = 2

# The instrument table is the telemetry package's own (telemetry.instrumentation.instruments.INSTRUMENTS, which
# follows docs/conventions.md's "Metrics" table); the series are made by its own create_instruments().
# The page lists the attribute keys and their enumerated values; the values below are those, the
# dtype ones (free-form on the page) are examples.
DTYPES = ("bfloat16", "float32")
ATTRIBUTE_VALUES: dict[str, tuple[str, ...]] = {
    semconv.ATTR_CAST_KIND: semconv.CAST_KINDS,
    semconv.ATTR_DTYPE_SOURCE: DTYPES,
    semconv.ATTR_DTYPE_TARGET: DTYPES,
    semconv.ATTR_DTYPE_PARAM: DTYPES,
    semconv.ATTR_DTYPE_GRAD: DTYPES,
    semconv.ATTR_MISMATCH_ACTION: semconv.MISMATCH_ACTIONS,
    semconv.ATTR_TENSOR: semconv.TENSORS,
    semconv.ATTR_NONFINITE_KIND: semconv.NONFINITE_KINDS,
    semconv.ATTR_DTYPE_EXPECTED: DTYPES,
    semconv.ATTR_DTYPE_ACTUAL: DTYPES,
}
# An attribute whose values differ for one instrument: the dtype audit also names optimizer state.
INSTRUMENT_VALUES: dict[tuple[str, str], tuple[str, ...]] = {
    (semconv.METRIC_DTYPE_CONTRACT, semconv.ATTR_TENSOR): semconv.CONTRACT_TENSORS,
}
# With FSDP_PATCH_PRECISION_DETAIL=unit these carry fsdp.unit too (units of a model: the root is "").
UNIT_LABELLED = {
    semconv.METRIC_NONFINITE,
    semconv.METRIC_REFRESH_OVERFLOW,
    semconv.METRIC_REFRESH_UNDERFLOW,
    semconv.METRIC_REFRESH_ERROR,
    semconv.METRIC_LOST_RATIO,
    semconv.METRIC_GRAD_AMAX,
}
UNITS = ("", "blocks.0")


@dataclass(frozen=True)
class Metric:
    name: str  # OpenTelemetry instrument name
    kind: str  # Counter, Histogram, Gauge
    unit: str
    attributes: dict[str, tuple[str, ...]]  # attribute key -> values to produce series for


def instrument_table() -> list[Metric]:
    from fsdp_patch.telemetry.instrumentation.instruments import INSTRUMENTS

    return [
        Metric(
            spec.name,
            spec.kind,
            spec.unit,
            {key: INSTRUMENT_VALUES.get((spec.name, key), ATTRIBUTE_VALUES[key]) for key in spec.attributes},
        )
        for spec in INSTRUMENTS
    ]


@dataclass(frozen=True)
class Series:
    name: str  # sample name as exposed, e.g. fsdp_optimizer_cast_size_bytes_total
    family_type: str  # counter, gauge, histogram
    labels: tuple  # sorted (label, value) pairs
    value: float


def exposition_for_rank(rank: str) -> str:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    reader = PrometheusMetricReader(registry=registry)
    provider = MeterProvider(
        metric_readers=[reader],
        resource=Resource.create(
            {"service.name": "fsdp_patch", semconv.RESOURCE_RANK: int(rank), semconv.RESOURCE_WORLD_SIZE: WORLD_SIZE}
        ),
    )
    try:
        from fsdp_patch.telemetry.instrumentation.instruments import RANK_ATTRIBUTE, create_instruments

        instruments = create_instruments(provider.get_meter("fsdp_patch"))
        for metric in instrument_table():
            keys = sorted(metric.attributes)
            units = ((semconv.ATTR_UNIT, u) for u in UNITS) if metric.name in UNIT_LABELLED else ()
            for values, unit in itertools.product(
                itertools.product(*(metric.attributes[k] for k in keys)), (None, *units)
            ):
                point = {
                    RANK_ATTRIBUTE: int(rank),
                    **dict(zip(keys, values, strict=True)),
                    **dict([unit] if unit else []),
                }
                instrument = instruments[metric.name]
                if metric.kind == "Counter":
                    instrument.add(3, point)
                elif metric.kind == "Histogram":
                    for seconds in (0.002, 0.03, 0.4):
                        instrument.record(seconds, point)
                elif metric.kind == "Gauge":
                    instrument.set(0.5, point)
                else:  # pragma: no cover - new instrument kind
                    raise AssertionError(f"no series recipe for {metric.kind} {metric.name}")
        return generate_latest(registry).decode()
    finally:
        provider.shutdown()


def design_prometheus_names(exporter_names) -> dict[str, set[str]]:
    """Instrument name -> the Prometheus sample names the exporter made of it."""
    out = {}
    table = instrument_table()
    for metric in table:
        name = metric.name
        base = name.replace(".", "_")
        out[name] = {n for n in exporter_names if n == base or n.startswith(base + "_")}
        # another metric whose name extends this one would be counted twice
        for other in table:
            o = other.name.replace(".", "_")
            if o != base and o.startswith(base + "_"):
                out[name] -= {n for n in out[name] if n.startswith(o)}
    return out


# ---------------------------------------------------------------------------------------------
# Dashboards and their queries


@dataclass(frozen=True)
class Query:
    source: str  # file and panel/variable it comes from, for messages
    expr: str  # as written (Grafana variables unexpanded)
    legend: str = ""
    kind: str = "panel"  # panel | variable | rule


def dashboard_files() -> list[Path]:
    return sorted((DASHBOARDS / "grafana").glob("*.json"))


def all_panels(dashboard: dict):
    for p in dashboard.get("panels", []):
        yield p
        yield from p.get("panels", [])  # panels of a collapsed row


def target_datasource_type(panel: dict, target: dict) -> str:
    ds = target.get("datasource") or panel.get("datasource") or {}
    return ds.get("type", "") if isinstance(ds, dict) else ""


LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?P<sel>.*?)\s*,\s*(?P<label>[a-zA-Z_]\w*)\s*\)\s*$", re.S)


def dashboard_queries(path: Path) -> list[Query]:
    dash = json.loads(path.read_text())
    out = []
    for panel in all_panels(dash):
        for t in panel.get("targets", []):
            if target_datasource_type(panel, t) == "prometheus":
                out.append(
                    Query(f"{path.name}: panel {panel['title']!r} {t['refId']}", t["expr"], t.get("legendFormat", ""))
                )
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var.get("query")
            q = q.get("query") if isinstance(q, dict) else q
            out.append(Query(f"{path.name}: variable {var['name']!r}", q, kind="variable"))
    return out


GRAFANA_BUILTINS = {
    "__rate_interval": "1m",
    "__interval": "1m",
    "__range": "10m",
    "__range_s": "600",
    "__interval_ms": "60000",
    "__all": ".*",
}
_VAR_REF = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)\]\]|\$(\w+)")


def variable_values(dashboard: dict) -> dict[str, str]:
    """What each template variable expands to when 'All' (or its default) is selected."""
    values = dict(GRAFANA_BUILTINS)
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("includeAll"):
            values[var["name"]] = var.get("allValue") or ".*"
        else:
            cur = var.get("current", {}).get("value")
            values[var["name"]] = cur if isinstance(cur, str) else var.get("query", "")
    return values


def variable_refs(text: str) -> set[str]:
    return {a or b or c for a, b, c in _VAR_REF.findall(text)}


def expand(text: str, values: dict[str, str]) -> str:
    return _VAR_REF.sub(lambda m: values[m.group(1) or m.group(2) or m.group(3)], text)


def query_as_promql(q: Query, dashboards: dict[str, dict]) -> str:
    """The query with Grafana's variables expanded; a label_values() variable query becomes the
    PromQL that lists the same label values."""
    expr = q.expr
    if q.kind != "rule":
        expr = expand(expr, variable_values(dashboards[q.source.split(":")[0]]))
    m = LABEL_VALUES.match(expr)
    if m:
        expr = f"count by ({m['label']}) ({m['sel']})"
    return expr


# ---------------------------------------------------------------------------------------------
# PromQL static reading: enough of the grammar to list metric names and label names.

_PROMQL_WORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "inf",
    "nan",
    "start",
    "end",
}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_SELECTOR = re.compile(r"(?<![\w:])([a-zA-Z_:][\w:]*)?\s*\{([^{}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)\s*(\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*')")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_IDENT = re.compile(r"(?<![\w.:])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()")


@dataclass
class PromQLRefs:
    metrics: set[str]
    matchers: list[tuple[str | None, set[str]]]  # (metric or None, label names matched)
    grouping: list[tuple[str, list[str]]]  # (by/on/..., labels) in text order


def promql_refs(expr: str) -> PromQLRefs:
    matchers = []
    for metric, body in _SELECTOR.findall(expr):
        labels = {lbl for lbl, _ in _MATCHER.findall(body)}
        name_matchers = re.findall(r'__name__\s*=\s*"([^"]*)"', body)
        matchers.append((metric or (name_matchers[0] if name_matchers else None), labels))
    grouping = [(kw, [lbl.strip() for lbl in body.split(",") if lbl.strip()]) for kw, body in _GROUPING.findall(expr)]
    bare = _STRING.sub('""', expr)
    bare = re.sub(r"\{[^{}]*\}", " ", bare)
    bare = re.sub(r"\[[^\]]*\]", " ", bare)
    bare = _GROUPING.sub(" ", bare)
    bare = re.sub(r"\boffset\s+-?[\dsmhdwy]+", " ", bare)
    metrics = {m for m in _IDENT.findall(bare) if m not in _PROMQL_WORDS}
    metrics |= {m for m, _ in matchers if m}
    return PromQLRefs(metrics, matchers, grouping)


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())
