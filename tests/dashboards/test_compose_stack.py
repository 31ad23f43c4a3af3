"""Static checks of dashboards/ beyond the dashboards: the names the Collector's Prometheus exporter
makes relabel to the exporter's, the compose stack's services, mounted files and addresses fit
together, the install script and the README's setup, and no dashboard file outside Grafana's folder."""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlparse

import pytest
from dashboards_support import (  # conftest.py puts this folder on sys.path
    DASHBOARDS,
    MAIN_DASHBOARD,
    PROVISIONED,
    all_panels,
    dashboard_files,
    design_prometheus_names,
    instrument_table,
    load_yaml,
)

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
