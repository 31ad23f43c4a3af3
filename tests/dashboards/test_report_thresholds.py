"""The precision report and the Prometheus alerts judge with the same thresholds.

``telemetry/precision_thresholds.py`` is the one table; every row naming an alert must match
that alert in ``dashboards/prometheus/rules.yml`` (metric, comparison, threshold, severity), and
every alert on a precision metric must be a row of the table. The dashboard's red lines on
the lost-update ratio and gradient amax are the same numbers too.
"""

from __future__ import annotations

import json
import re

import pytest

from fsdp_patch.telemetry import precision_thresholds as thresholds
from tests.dashboards.dashboards_support import DASHBOARDS, load_yaml

# `<aggregation> (<metric>{...}) > <number>` as the rules write them, on a line of its own (the
# first such line is the alert's condition; a rule may go on to count diagnosed steps); the
# Prometheus name of an instrument is its name with dots as underscores plus `_total` for counters.
_EXPR = re.compile(r"\((?P<metric>fsdp_[a-z_]+)(?:\{[^}]*\})?\)\s*(?P<op>>|<=|<)\s*(?P<value>[0-9.eE+-]+)\s*$", re.M)


def _alerts() -> dict[str, dict]:
    doc = load_yaml(DASHBOARDS / "prometheus" / "rules.yml")
    return {rule["alert"]: rule for group in doc["groups"] for rule in group["rules"] if "alert" in rule}


def _prometheus_base(metric: str) -> str:
    return metric.replace(".", "_")


@pytest.mark.parametrize("threshold", [t for t in thresholds.THRESHOLDS if t.alert], ids=lambda t: t.check)
def test_each_alerted_threshold_equals_its_alert(threshold: thresholds.Threshold) -> None:
    alerts = _alerts()
    assert threshold.alert in alerts, f"rules.yml has no alert {threshold.alert} (threshold {threshold.check})"
    rule = alerts[threshold.alert]
    match = _EXPR.search(rule["expr"].strip())
    assert match, f"{threshold.alert}: expression not of the form `agg (metric) > N`: {rule['expr']!r}"
    got_metric = match["metric"].removesuffix("_total")
    assert got_metric == _prometheus_base(threshold.metric), (
        f"{threshold.alert} reads {match['metric']}, the report's {threshold.check} reads {threshold.metric}"
    )
    assert match["op"] == ">" and threshold.above is not None, f"{threshold.alert}: comparison {match['op']}"
    assert float(match["value"]) == threshold.above, (
        f"{threshold.alert} fires above {match['value']}, the report's {threshold.check} above {threshold.above}"
    )
    got_severity = thresholds.ALERT_SEVERITY[rule["labels"]["severity"]]
    assert got_severity == threshold.severity, (
        f"{threshold.alert} is {rule['labels']['severity']} ({got_severity}), the report says {threshold.severity}"
    )


def test_every_precision_alert_is_a_report_threshold() -> None:
    covered = {t.alert for t in thresholds.THRESHOLDS if t.alert}
    precision_alerts = {name for name, rule in _alerts().items() if "fsdp_precision_" in rule["expr"]}
    assert precision_alerts, "rules.yml has no alert on a precision metric"
    assert precision_alerts <= covered, f"alerts the report does not judge by: {sorted(precision_alerts - covered)}"


def _red_line(title: str) -> float:
    dashboard = json.loads((DASHBOARDS / "grafana" / "fsdp_optimizer.json").read_text())
    stack = list(dashboard["panels"])
    while stack:
        panel = stack.pop()
        stack.extend(panel.get("panels", []))
        if panel.get("title") == title:
            steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
            return next(step["value"] for step in steps if step["color"] == "red")
    raise AssertionError(f"no panel {title!r}")


@pytest.mark.parametrize(
    ("title", "check"),
    [("Lost-update ratio", "lost_updates"), ("Gradient amax (largest |main grad|)", "grad_amax_fp16")],
)
def test_dashboard_red_lines_equal_report_thresholds(title: str, check: str) -> None:
    got, want = _red_line(title), thresholds.BY_CHECK[check].above
    assert got == want, f"panel {title!r} turns red at {got}, the report's {check} at {want}"


def test_readme_table_is_the_threshold_table() -> None:
    readme = (DASHBOARDS.parent / "telemetry" / "README.md").read_text()
    assert thresholds.markdown_table() in readme, "telemetry/README.md's threshold table differs from THRESHOLDS"
