"""The demo's planted scenarios fire their alerts in a real Prometheus evaluating rules.yml.

Runs ``dashboards/demo_alerts.py`` (the script docs/report.md quotes; 300 steps per scenario by default) with short
runs: Prometheus on loopback scraping every second, ``fsdp-patch demo --exporter prometheus`` per
scenario. The Prometheus server is installed here when it is missing (Debian's package, as
``dashboards/install_promtool.sh prometheus`` does). Slow: four demo runs of 2 ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dashboards_support import DASHBOARDS  # conftest.py puts this folder on sys.path

pytestmark = pytest.mark.long  # a Prometheus server and the demo per scenario

STEPS = 20  # the planted bugs land at step 10; tiny-lr's third diagnosed step is step 10
DASHBOARD = DASHBOARDS / "grafana" / "fsdp_optimizer.json"


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found:
        return found
    bindir = Path(sys.prefix) / "bin"  # the project's environment
    if not (bindir / "prometheus").exists():
        install = subprocess.run(
            ["bash", str(DASHBOARDS / "install_promtool.sh"), "prometheus"],
            env={**os.environ, "PROMTOOL_DIR": str(bindir)},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert install.returncode == 0, f"installing prometheus failed:\n{install.stdout}\n{install.stderr}"
    return str(bindir / "prometheus")


@pytest.fixture(scope="module")
def demo_alerts(prometheus_binary: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("demo_alerts") / "alerts.json"
    result = subprocess.run(
        [
            sys.executable,
            str(DASHBOARDS / "demo_alerts.py"),
            "--steps",
            str(STEPS),
            "--prometheus",
            prometheus_binary,
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert out.exists(), (
        f"demo_alerts.py exited {result.returncode} without results:\n{result.stdout}\n{result.stderr[-3000:]}"
    )
    runs = {run["scenario"]: run for run in json.loads(out.read_text())}
    runs["_output"] = {"stdout": result.stdout, "returncode": result.returncode}
    return runs


@pytest.mark.parametrize(
    ("scenario", "alert"),
    [("nan", "FsdpNonFiniteValues"), ("fp16-overflow", "FsdpRefreshOverflow"), ("tiny-lr", "FsdpLostUpdateRatioHigh")],
)
def test_each_planted_scenario_fires_its_alert_for_both_ranks(demo_alerts: dict, scenario: str, alert: str) -> None:
    run = demo_alerts[scenario]
    fired = {f["alert"]: f for f in run["fired"]}
    assert alert in fired, (
        f"{scenario}: want {alert} firing, fired {sorted(fired)}:\n{demo_alerts['_output']['stdout']}"
    )
    assert fired[alert]["ranks"] == ["0", "1"], f"{scenario}: {alert} fired for ranks {fired[alert]['ranks']}"
    if fired[alert]["step"] is not None and run["plant_step"]:
        assert fired[alert]["step"] >= run["plant_step"], (
            f"{scenario}: {alert} fired at step {fired[alert]['step']}, before the plant"
        )


def test_a_healthy_run_fires_no_alert(demo_alerts: dict) -> None:
    fired = [f["alert"] for f in demo_alerts["healthy"]["fired"]]
    assert fired == [], f"a healthy {STEPS}-step demo fired {fired}"


def test_the_demo_prints_its_endpoints_and_reports_as_the_dashboards_service(demo_alerts: dict) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    (service,) = [v for v in dashboard["templating"]["list"] if v["name"] == "service"]
    default = service["current"]["value"]
    for scenario in ("nan", "fp16-overflow", "tiny-lr", "healthy"):
        run = demo_alerts[scenario]
        assert len(run["endpoints"]) == 2, f"{scenario}: want both ranks' endpoints printed, got {run['endpoints']}"
        assert run["service_names"] == [default], (
            f"{scenario}: the demo reports as service {run['service_names']}, the dashboard's Jaeger panel defaults to {default!r}"
        )
    assert demo_alerts["_output"]["returncode"] == 0, demo_alerts["_output"]["stdout"]
