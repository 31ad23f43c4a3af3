"""The precision panels show what their titles say, on the series a real run exposes.

A run of the real observer, its metrics read by the real OpenTelemetry Prometheus exporter and
scraped once per step (a minute apart), gives promtool its input. From step 3 on, every step's
main weights hold ``NAN_ELEMENTS`` NaNs (as after a NaN update) and its fp16 refresh overflows
``OVERFLOW_ELEMENTS`` elements: each diagnosed step counts them again, so the counters' totals are
element-steps, which a panel about elements or steps must not show.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from dashboards_support import Query, query_as_promql  # conftest.py puts this folder on sys.path
from prometheus_client.parser import text_string_to_metric_families

from tests.telemetry.telemetry_testing import Group, fake_optimizer, run_fake_step

STEPS = 6
FIRST_BAD_STEP = 3
NAN_ELEMENTS = 4
OVERFLOW_ELEMENTS = 2
SCRAPE = "1m"


def _group(step: int) -> tuple[Group, torch.Tensor]:
    """An fp16-compute group and the main weight the step writes (bad from FIRST_BAD_STEP on)."""
    main = torch.linspace(0.5, 1.5, 64)
    new = main + 0.25 * step
    if step >= FIRST_BAD_STEP:
        new[:NAN_ELEMENTS] = math.nan
        new[NAN_ELEMENTS : NAN_ELEMENTS + OVERFLOW_ELEMENTS] = 7.0e4  # beyond fp16: Inf once refreshed
    return Group(main, main.to(torch.float16), torch.ones(64, dtype=torch.float16)), new


@pytest.fixture(scope="module")
def scraped_run() -> list[dict[str, float]]:
    """Per scrape (one per step), every fsdp_* sample of the run: series text -> value."""
    from fsdp_patch.telemetry import OptimizerObserver
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    meter_provider = MeterProvider(metric_readers=[PrometheusMetricReader(registry=registry)])
    with pytest.MonkeyPatch.context() as env:
        env.setenv("FSDP_PATCH_PRECISION_EVERY", "1")
        observer = OptimizerObserver(
            fake_optimizer(), precision_aware=False, tracer_provider=TracerProvider(), meter_provider=meter_provider
        )
        scrapes = []
        for step in range(1, STEPS + 1):
            group, new = _group(step)
            run_fake_step(observer, [group], [new])
            samples = {}
            for family in text_string_to_metric_families(generate_latest(registry).decode()):
                for sample in family.samples:
                    if sample.name.startswith("fsdp_precision_"):
                        labels = dict(sample.labels, job="train", instance="localhost:9464")
                        text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                        samples[f"{sample.name}{{{text}}}"] = sample.value
            scrapes.append(samples)
    meter_provider.shutdown()
    return scrapes


def _panel_query(dashboards: dict, panel_id: int, ref_id: str = "A") -> str:
    ((name, dashboard),) = [(n, d) for n, d in dashboards.items() if n == "fsdp_optimizer.json"]
    (panel,) = [p for p in dashboard["panels"] if p.get("id") == panel_id]
    (target,) = [t for t in panel["targets"] if t["refId"] == ref_id]
    return query_as_promql(Query(f"{name}: panel {panel['title']!r} {ref_id}", target["expr"]), dashboards)


def _evaluate(
    promtool: str, tmp_path: Path, scrapes: list[dict[str, float]], expr: str, want: list[tuple[str, float]]
) -> None:
    keys = sorted({key for scrape in scrapes for key in scrape})
    series = [{"series": key, "values": " ".join(f"{s[key]:g}" if key in s else "_" for s in scrapes)} for key in keys]
    test = {
        "expr": expr,
        "eval_time": f"{STEPS - 1}m",
        "exp_samples": [{"labels": labels, "value": value} for labels, value in want],
    }
    (tmp_path / "empty_rules.yml").write_text("groups: []\n")
    suite = {
        "rule_files": ["empty_rules.yml"],
        "evaluation_interval": SCRAPE,
        "tests": [{"interval": SCRAPE, "input_series": series, "promql_expr_test": [test]}],
    }
    (tmp_path / "panel_test.yml").write_text(yaml.safe_dump(suite, sort_keys=False, width=10_000))
    proc = subprocess.run(
        [promtool, "test", "rules", "panel_test.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"{expr}\nwant {want}; promtool says:\n{proc.stdout}\n{proc.stderr}"


def test_the_overview_stat_counts_diagnosed_steps_with_nan_or_inf(promtool, dashboards, scraped_run, tmp_path) -> None:
    bad_steps = STEPS - FIRST_BAD_STEP + 1
    _evaluate(promtool, tmp_path, scraped_run, _panel_query(dashboards, 3), [('{fsdp_rank="0"}', bad_steps)])


def test_the_non_finite_panel_shows_a_diagnosed_steps_elements(promtool, dashboards, scraped_run, tmp_path) -> None:
    want = [
        (f'{{fsdp_rank="0",fsdp_tensor="{tensor}",fsdp_nonfinite_kind="{kind}"}}', count)
        for tensor, kind, count in (
            ("main_grad", "nan", 0),
            ("main_grad", "inf", 0),
            ("main_weight", "nan", NAN_ELEMENTS),
            ("main_weight", "inf", 0),
            ("compute_weight", "nan", NAN_ELEMENTS),
            ("compute_weight", "inf", OVERFLOW_ELEMENTS),
        )
    ]
    _evaluate(promtool, tmp_path, scraped_run, _panel_query(dashboards, 17), want)


def test_the_overflow_panel_shows_a_diagnosed_steps_elements(promtool, dashboards, scraped_run, tmp_path) -> None:
    _evaluate(
        promtool, tmp_path, scraped_run, _panel_query(dashboards, 18, "A"), [('{fsdp_rank="0"}', OVERFLOW_ELEMENTS)]
    )
    _evaluate(promtool, tmp_path, scraped_run, _panel_query(dashboards, 18, "B"), [('{fsdp_rank="0"}', 0)])
