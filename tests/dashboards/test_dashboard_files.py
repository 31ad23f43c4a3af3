"""Static checks of dashboards/: files parse, dashboards use only the Prometheus names and labels
the real exporter produces for the instruments of docs/conventions.md, every design metric is on a panel,
template variables resolve, and the compose stack's files and addresses fit together."""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from dashboards_support import (  # conftest.py puts this folder on sys.path
    DASHBOARDS,
    LABEL_VALUES,
    all_panels,
    dashboard_files,
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

MAIN_DASHBOARD = "fsdp_optimizer.json"
PROVISIONED = DASHBOARDS / "grafana" / "provisioning"
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


# --- Collector path: names after the Collector's Prometheus exporter ---------------------------

_UNITS = {"s": "seconds", "By": "bytes"}


def collector_name(name: str, kind: str, unit: str) -> list[str]:
    """Model of the Collector's Prometheus exporter naming (add_metric_suffixes, the default):
    unit suffix (UCUM annotations in braces dropped), `_total` for monotonic sums, and `_ratio`
    appended to gauges of unit "1" (the Python exporter maps "1" to nothing)."""
    tokens = [t for t in re.split(r"[^a-zA-Z0-9]+", name) if t]
    u = re.sub(r"\{.*\}", "", unit)
    suffix = _UNITS.get(u, "" if u == "1" else u)
    if suffix and suffix not in tokens:
        tokens.append(suffix)
    if kind == "Counter":
        tokens = [t for t in tokens if t != "total"] + ["total"]
    if kind == "Gauge" and unit == "1":
        tokens = [t for t in tokens if t != "ratio"] + ["ratio"]
    base = "_".join(tokens)
    return [base + s for s in ("_bucket", "_count", "_sum")] if kind == "Histogram" else [base]


def _apply_metric_relabel(name: str, configs: list[dict]) -> str:
    labels = {"__name__": name}
    for c in configs:
        src = c.get("separator", ";").join(labels.get(s, "") for s in c.get("source_labels", []))
        m = re.fullmatch(c.get("regex", "(.*)"), src)
        action = c.get("action", "replace")
        assert action == "replace", "model handles replace only"
        if m:
            repl = re.sub(r"\$\{?(\d+)\}?", lambda g: m.group(int(g.group(1))) or "", c.get("replacement", "$1"))
            labels[c["target_label"]] = repl
    return labels["__name__"]


def test_collector_names_relabel_to_the_exporter_names(exporter_names):
    prom = load_yaml(DASHBOARDS / "prometheus" / "prometheus.yml")
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "otel-collector")
    configs = job.get("metric_relabel_configs", [])
    per_metric = design_prometheus_names(exporter_names)
    for m in instrument_table():
        got = {_apply_metric_relabel(n, configs) for n in collector_name(m.name, m.kind, m.unit)}
        assert got == per_metric[m.name], (m.name, got)
    # and the rewrite leaves everything else alone
    for n in exporter_names:
        assert _apply_metric_relabel(n, configs) == n


# --- compose stack ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose():
    return load_yaml(DASHBOARDS / "compose.yaml")


def _mounts(service: dict) -> dict[str, Path]:
    """container path -> host path, for bind mounts."""
    out = {}
    for v in service.get("volumes", []):
        src, dst = v.split(":")[:2]
        out[dst] = (DASHBOARDS / src).resolve()
    return out


def _host_path(service: dict, container_path: str) -> Path | None:
    for dst, src in sorted(_mounts(service).items(), key=lambda kv: -len(kv[0])):
        if container_path == dst:
            return src
        if container_path.startswith(dst.rstrip("/") + "/"):
            return src / container_path[len(dst.rstrip("/")) + 1 :]
    return None


def test_compose_services_and_mounted_files(compose):
    services = compose["services"]
    assert set(services) >= {"otel-collector", "jaeger", "prometheus", "grafana"}
    for name, svc in services.items():
        assert re.fullmatch(r"[\w./-]+:[\w.-]+", svc["image"]) and not svc["image"].endswith(":latest"), name
        for dst, src in _mounts(svc).items():
            assert src.exists(), f"{name}: mounts missing {src} (at {dst})"
            assert src.is_relative_to(DASHBOARDS), f"{name}: mounts {src} from outside dashboards/"
        for dep in svc.get("depends_on", []):
            assert dep in services, (name, dep)


def _flag(args: list[str], flag: str) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith(flag + "="))


def test_compose_configs_are_the_checked_files(compose):
    s = compose["services"]
    col = _host_path(s["otel-collector"], _flag(s["otel-collector"]["command"], "--config"))
    assert col == (DASHBOARDS / "otel-collector" / "config.yaml").resolve()
    prom_cfg = _flag(s["prometheus"]["command"], "--config.file")
    assert _host_path(s["prometheus"], prom_cfg) == (DASHBOARDS / "prometheus" / "prometheus.yml").resolve()
    for rule_file in load_yaml(DASHBOARDS / "prometheus" / "prometheus.yml")["rule_files"]:
        in_container = str(Path(prom_cfg).parent / rule_file)
        assert _host_path(s["prometheus"], in_container) == (DASHBOARDS / "prometheus" / rule_file).resolve()
    g = s["grafana"]
    assert _host_path(g, "/etc/grafana/provisioning") == PROVISIONED.resolve()
    for f in (PROVISIONED / "dashboards").glob("*.yaml"):
        for provider in load_yaml(f)["providers"]:
            folder = _host_path(g, provider["options"]["path"])
            assert folder is not None and (folder / MAIN_DASHBOARD).is_file(), provider
    assert g["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert g["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Admin"
    home = _host_path(g, g["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert home is not None and home.is_file()


def _ports(svc: dict) -> set[int]:
    return {int(str(p).split(":")[-1].split("/")[0]) for p in svc.get("ports", [])}


def test_addresses_between_services_fit(compose):
    s = compose["services"]
    col = load_yaml(DASHBOARDS / "otel-collector" / "config.yaml")
    prom = load_yaml(DASHBOARDS / "prometheus" / "prometheus.yml")

    # the job's OTLP ports are open on the collector
    protocols = col["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"].endswith(":4317") and protocols["http"]["endpoint"].endswith(":4318")
    assert {4317, 4318} <= _ports(s["otel-collector"])

    # Prometheus scrapes the collector's Prometheus exporter
    exporter_port = col["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
    assert col["exporters"]["prometheus"]["resource_to_telemetry_conversion"]["enabled"] is True
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "otel-collector")
    assert job["static_configs"][0]["targets"] == [f"otel-collector:{exporter_port}"]

    # the per-rank pull endpoints: base 9464 + local_rank, on the host
    ranks = next(j for j in prom["scrape_configs"] if j["job_name"] == "fsdp-ranks")
    targets = ranks["static_configs"][0]["targets"]
    assert targets[0] == "host.docker.internal:9464"
    assert [int(t.rsplit(":", 1)[1]) for t in targets] == list(range(9464, 9464 + len(targets)))
    assert "host.docker.internal:host-gateway" in s["prometheus"]["extra_hosts"]

    # traces go to Jaeger's OTLP gRPC receiver
    jaeger_exporters = [k for k in col["exporters"] if k.split("/")[0] == "otlp"]
    assert jaeger_exporters and col["exporters"][jaeger_exporters[0]]["endpoint"] == "jaeger:4317"
    assert s["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"

    # every pipeline component is defined
    pipes = col["service"]["pipelines"]
    assert set(pipes) == {"traces", "metrics"}
    for pipe in pipes.values():
        for section in ("receivers", "processors", "exporters"):
            for comp in pipe.get(section, []):
                assert comp in col[section], comp
    assert "batch" in pipes["traces"]["processors"] and "batch" in pipes["metrics"]["processors"]
    assert pipes["traces"]["exporters"] == jaeger_exporters
    assert pipes["metrics"]["exporters"] == ["prometheus"]

    # Grafana's datasources point at compose services on their ports
    for f in (PROVISIONED / "datasources").glob("*.yaml"):
        for ds in load_yaml(f)["datasources"]:
            url = urlparse(ds["url"])
            assert url.hostname in s, ds["url"]
            assert (url.hostname, url.port) in {("prometheus", 9090), ("jaeger", 16686)}, ds["url"]
            assert url.port in _ports(s[url.hostname]), ds["url"]


def test_install_script_is_executable_bash():
    script = DASHBOARDS / "install_promtool.sh"
    assert script.stat().st_mode & 0o111
    assert script.read_text().startswith("#!/usr/bin/env bash")


def test_readme_documents_the_setup():
    readme = (DASHBOARDS / "README.md").read_text()
    for needle in [
        "docker compose",
        "OTEL_EXPORTER_OTLP_ENDPOINT=http://localhost:4318",
        "OTEL_TRACES_EXPORTER=otlp",
        "OTEL_METRICS_EXPORTER=otlp",
        "FSDP_PATCH_TELEMETRY=1",
        "9464",
        "Perfetto",
        "install_promtool.sh",
    ]:
        assert needle in readme, needle
    titles = [
        p["title"]
        for p in all_panels(json.loads((DASHBOARDS / "grafana" / MAIN_DASHBOARD).read_text()))
        if p["type"] not in {"row", "text"}
    ]
    for t in titles:
        assert t.split(" (")[0] in readme, f"README does not explain panel {t!r}"


def test_no_dashboard_file_outside_grafana_folder():
    assert dashboard_files() == sorted((DASHBOARDS / "grafana").glob("*.json"))
