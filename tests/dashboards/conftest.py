"""Fixtures for the dashboards/ tests; the helpers they use are in dashboards_support.py."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

# Make dashboards_support importable from the test modules in every --import-mode.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from dashboards_support import (  # noqa: E402
    DASHBOARDS,
    INSTALL_PROMTOOL,
    RANKS,
    Query,
    Series,
    dashboard_files,
    dashboard_queries,
    exposition_for_rank,
    load_yaml,
)


@pytest.fixture(scope="session")
def exporter_series() -> list[Series]:
    """Every sample the real exporter exposes for the instruments of docs/conventions.md, both ranks, with the
    `job` and `instance` labels Prometheus adds when scraping the per-rank endpoints."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for rank in RANKS:
        text = exposition_for_rank(rank)
        for fam in text_string_to_metric_families(text):
            if not (fam.name.startswith("fsdp_") or fam.name == "target_info"):
                continue  # python_gc_*, process_*: not in the test's own registry anyway
            for s in fam.samples:
                labels = dict(s.labels, job="fsdp-ranks", instance=f"localhost:{9464 + int(rank)}")
                out.append(Series(s.name, fam.type, tuple(sorted(labels.items())), s.value))
    return out


@pytest.fixture(scope="session")
def exporter_names(exporter_series) -> dict[str, set[str]]:
    """Prometheus sample name -> label names it carries (job/instance included)."""
    names: dict[str, set[str]] = {}
    for s in exporter_series:
        names.setdefault(s.name, set()).update(k for k, _ in s.labels)
    return names


@pytest.fixture(scope="session")
def dashboards() -> dict[str, dict]:
    files = dashboard_files()
    assert files, "no dashboards/grafana/*.json"
    return {p.name: json.loads(p.read_text()) for p in files}


@pytest.fixture(scope="session")
def panel_queries() -> list[Query]:
    return [q for p in dashboard_files() for q in dashboard_queries(p)]


@pytest.fixture(scope="session")
def rule_queries() -> list[Query]:
    doc = load_yaml(DASHBOARDS / "prometheus" / "rules.yml")
    return [
        Query(f"rules.yml: {r.get('record') or r.get('alert')}", r["expr"], kind="rule")
        for g in doc["groups"]
        for r in g["rules"]
    ]


@pytest.fixture(scope="session")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is not on PATH: the dashboards' PromQL, prometheus.yml and the alert rules "
            f"are validated with it. Install it with `bash {INSTALL_PROMTOOL}` (on Debian it "
            "extracts promtool from the `prometheus` package, about 19 MB to download).",
            pytrace=False,
        )
    return path
