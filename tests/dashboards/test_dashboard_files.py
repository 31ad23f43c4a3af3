"""Static checks of dashboards/: files parse, dashboards use only the Prometheus names and labels
the real exporter produces for the instruments of docs/conventions.md, every design metric is on a panel,
template variables resolve. The Collector path and the compose stack: test_compose_stack.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from dashboards_support import (  # conftest.py puts this folder on sys.path
    DASHBOARDS,
    LABEL_VALUES,
    MAIN_DASHBOARD,
    PROVISIONED,
    all_panels,
    design_prometheus_names,
    instrument_table,
    load_yaml,
    promql_refs,
    target_datasource_type,
    variable_refs,
    variable_values,
)
from fsdp_patch.telemetry import semconv

from tests import conventions_doc as conventions

# Labels Prometheus itself attaches to every scraped series.
SCRAPE_LABELS = {"job", "instance"}


def _all_config_files():
    return sorted(p for p in DASHBOARDS.rglob("*") if p.suffix in {".json", ".yaml", ".yml"})


# --- parsing -----------------------------------------------------------------------------------


def test_expected_files_exist():
    for rel in [
        "grafana/fsdp_optimizer.json",
        "prometheus/prometheus.yml",
        "prometheus/rules.yml",
        "prometheus/rules_test.yml",
        "otel-collector/config.yaml",
        "compose.yaml",
        "README.md",
        "install_promtool.sh",
    ]:
        assert (DASHBOARDS / rel).is_file(), rel
    assert list((PROVISIONED / "datasources").glob("*.yaml"))
    assert list((PROVISIONED / "dashboards").glob("*.yaml"))


@pytest.mark.parametrize("path", _all_config_files(), ids=lambda p: str(p.relative_to(DASHBOARDS)))
def test_config_file_parses(path: Path):
    doc = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
    assert isinstance(doc, dict) and doc, f"{path} is empty or not a mapping"


# --- the instruments' Prometheus names ------------------------------------------------------------


def _page_prometheus_names() -> dict[str, list[str]]:
    """docs/conventions.md's Prometheus table, ``_{bucket,count,sum}`` written out."""
    names = {}
    for instrument, exposed in conventions.table_rows(conventions.section("Metrics"), "instrument"):
        written = conventions.code_spans(exposed)[0]
        stem, _, suffixes = written.partition("{")
        names[conventions.code_spans(instrument)[0]] = (
            sorted(stem + s for s in suffixes.rstrip("}").split(",")) if suffixes else [written]
        )
    return names


def test_exporter_names_are_the_conventions_pages(exporter_names):
    """Pins the translation of opentelemetry-exporter-prometheus to the names docs/conventions.md
    promises the dashboards and users: if an exporter release renames these, this fails first and
    says how."""
    per_metric = design_prometheus_names(exporter_names)
    got = {m: sorted(n) for m, n in per_metric.items()}
    want = _page_prometheus_names()
    assert got == want, f"the exporter exposes {got}, docs/conventions.md says {want}"
    # distinct after translation, and every series split by rank
    assert sum(len(v) for v in per_metric.values()) == len(set().union(*per_metric.values()))
    for name, labels in exporter_names.items():
        if name != "target_info":
            assert "fsdp_rank" in labels, name
    assert {"fsdp_rank", "fsdp_world_size"} <= exporter_names["target_info"]


def test_instrument_table_and_attribute_values_are_the_conventions_pages():
    """The dashboards are built on telemetry.instrumentation.instruments: that table, and the attribute values the
    series here are made for, are docs/conventions.md's metric table."""
    rows = conventions.table_rows(conventions.section("Metrics"), "name")
    table = {
        conventions.code_spans(name)[0]: (
            kind,
            conventions.code_spans(unit)[0],
            set(re.findall(r"`(fsdp\.[\w.]+)`", attrs)),
        )
        for name, kind, unit, attrs in rows
    }
    ours = {m.name: (m.kind, m.unit, set(m.attributes)) for m in instrument_table()}
    assert table == ours, f"docs/conventions.md {table}, telemetry.instrumentation.instruments {ours}"
    made = {m.name: m.attributes for m in instrument_table()}
    for name, _, _, attrs in rows:
        for key in re.findall(r"`(fsdp\.[\w.]+)`", attrs):
            listed = re.findall(rf"`{re.escape(key)}` \(([^)]*)\)", attrs)
            if listed:  # an enumerated attribute: produce exactly the page's values
                got = set(made[conventions.code_spans(name)[0]][key])
                want = set(re.findall(r"`(\w+)`", listed[0]))
                assert got == want, f"{name} {key}: series made for {sorted(got)}, the page lists {sorted(want)}"


# --- PromQL in dashboards and rules -------------------------------------------------------------


def _check_names_and_labels(q, exporter_names):
    expr, listed = q.expr, None
    if q.kind == "variable":
        m = LABEL_VALUES.match(q.expr)
        assert m, f"{q.source}: not a label_values(selector, label) query: {q.expr!r}"
        expr, listed = m["sel"], m["label"]
    refs = promql_refs(expr)
    assert refs.metrics, f"{q.source}: no metric in {q.expr!r}"
    unknown = refs.metrics - set(exporter_names)
    assert not unknown, (
        f"{q.source}: {sorted(unknown)} are not names the Prometheus exporter "
        f"produces for the telemetry instruments (known: {sorted(exporter_names)})"
    )
    known_labels = set().union(*(exporter_names[m] for m in refs.metrics)) | SCRAPE_LABELS
    for metric, labels in refs.matchers:
        allowed = (exporter_names[metric] if metric in exporter_names else known_labels) | SCRAPE_LABELS
        bad = labels - allowed - {"__name__"}
        assert not bad, f"{q.source}: {metric} has no label {sorted(bad)}"
    for kw, labels in refs.grouping:
        bad = set(labels) - known_labels
        assert not bad, f"{q.source}: {kw} ({', '.join(labels)}) names unknown labels {sorted(bad)}"
    if listed is not None:
        assert listed in known_labels, f"{q.source}: lists label {listed!r} the metric does not have"
    return refs


def test_panel_queries_use_only_exporter_names_and_labels(panel_queries, exporter_names):
    assert len([q for q in panel_queries if q.kind == "panel"]) >= 15
    for q in panel_queries:
        refs = _check_names_and_labels(q, exporter_names)
        if q.legend:
            shown = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", q.legend))
            by = next((labels for kw, labels in refs.grouping if kw in {"by"}), None)
            assert by is not None, f"{q.source}: legend uses labels but the query keeps none"
            assert shown <= set(by), f"{q.source}: legend {q.legend!r} shows labels not in by ({by})"


def test_rule_queries_use_only_exporter_names_and_labels(rule_queries, exporter_names):
    assert rule_queries
    for q in rule_queries:
        _check_names_and_labels(q, exporter_names)


def test_every_panel_query_is_split_by_rank_and_filtered_by_the_variables(panel_queries):
    for q in panel_queries:
        if q.kind != "panel":
            continue
        refs = promql_refs(q.expr)
        assert any("fsdp_rank" in labels for kw, labels in refs.grouping if kw == "by"), q.source
        for metric, labels in refs.matchers:
            assert {"job", "fsdp_rank"} <= labels, f"{q.source}: {metric} not filtered by $job/$rank"
        assert "$rank" in q.expr and "$job" in q.expr, q.source


def test_every_design_metric_is_on_a_panel(dashboards, panel_queries, exporter_names):
    used = set()
    for q in panel_queries:
        if q.source.startswith(MAIN_DASHBOARD) and q.kind == "panel":
            used |= promql_refs(q.expr).metrics
    missing = {m for m, names in design_prometheus_names(exporter_names).items() if not names & used}
    assert not missing, f"metrics on no panel of {MAIN_DASHBOARD}: {sorted(missing)}"


def test_histogram_quantiles_use_rate_of_buckets_by_le(panel_queries):
    quantiles = [q for q in panel_queries if "histogram_quantile" in q.expr]
    assert {q.expr.split("(", 2)[1].split(",")[0] for q in quantiles} >= {"0.5", "0.95"}
    for q in quantiles:
        assert re.search(r"rate\(\w+_bucket\{", q.expr), q.source
        assert any("le" in labels for kw, labels in promql_refs(q.expr).grouping if kw == "by"), q.source


# --- Grafana dashboards -----------------------------------------------------------------------


def test_dashboard_structure(dashboards):
    uids = set()
    for name, dash in dashboards.items():
        assert dash["schemaVersion"] >= 39, name
        assert dash["uid"] and dash["uid"] not in uids, name
        uids.add(dash["uid"])
        ids = [p["id"] for p in all_panels(dash)]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        cells = set()
        for p in all_panels(dash):
            g = p["gridPos"]
            assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, (name, p["title"])
            mine = {(g["x"] + dx, g["y"] + dy) for dx in range(g["w"]) for dy in range(g["h"])}
            assert not cells & mine, f"{name}: panel {p['title']!r} overlaps another"
            cells |= mine
            if p["type"] not in {"row", "text"}:
                assert p.get("targets"), (name, p["title"])
                assert p.get("description"), f"{name}: panel {p['title']!r} has no description"


def test_datasources_are_variables_whose_defaults_are_provisioned(dashboards):
    provisioned = {}
    for f in (PROVISIONED / "datasources").glob("*.yaml"):
        for ds in load_yaml(f)["datasources"]:
            provisioned[ds["uid"]] = ds["type"]
    for name, dash in dashboards.items():
        dsvars = {v["name"]: v for v in dash["templating"]["list"] if v["type"] == "datasource"}
        assert "DS_PROMETHEUS" in dsvars, name
        for var in dsvars.values():
            uid = var["current"]["value"]
            assert provisioned.get(uid) == var["query"], f"{name}: {var['name']} -> {uid!r}"
        for p in all_panels(dash):
            for holder in [p, *p.get("targets", [])]:
                ds = holder.get("datasource")
                if ds is None or p["type"] in {"row", "text"}:
                    continue
                m = re.fullmatch(r"\$\{(\w+)\}", ds["uid"])
                assert m and m.group(1) in dsvars, f"{name}: {p['title']!r} datasource {ds}"
                assert dsvars[m.group(1)]["query"] == ds["type"], (name, p["title"])


def test_template_variables_resolve(dashboards):
    for name, dash in dashboards.items():
        values = variable_values(dash)
        text = json.dumps(dash, ensure_ascii=False)
        undefined = variable_refs(text) - set(values)
        assert not undefined, f"{name}: undefined variables {sorted(undefined)}"
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        rank = variables["rank"]
        assert rank["type"] == "query"
        q = rank["query"]["query"] if isinstance(rank["query"], dict) else rank["query"]
        assert re.fullmatch(r"label_values\(.+,\s*fsdp_rank\)", q), q
        assert rank["includeAll"] and rank["multi"] and rank["allValue"] == ".*"


def test_trace_panel_searches_optimizer_step_spans(dashboards):
    dash = dashboards[MAIN_DASHBOARD]
    jaeger = [
        (p, t) for p in all_panels(dash) for t in p.get("targets", []) if target_datasource_type(p, t) == "jaeger"
    ]
    assert jaeger, "no Jaeger panel"
    for _, t in jaeger:
        assert t["queryType"] == "search" and t["operation"] == semconv.SPAN_STEP
    assert any(f"operation={semconv.SPAN_STEP}" in link["url"] for link in dash["links"])
