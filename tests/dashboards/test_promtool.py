"""Validation with Prometheus' own promtool: the config, the rules and their unit tests, and every
PromQL query of the dashboards, parsed by promtool and evaluated against series named and labelled
exactly as the real OpenTelemetry Prometheus exporter exposes the instruments of docs/conventions.md.

promtool must be installed (dashboards/install_promtool.sh); without it these tests fail."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml
from dashboards_support import DASHBOARDS, RANKS, query_as_promql  # conftest.py puts this folder on sys.path
from fsdp_patch.telemetry import semconv

PROM_DIR = DASHBOARDS / "prometheus"
SCRAPE_INTERVAL = "15s"
SAMPLES = 60  # 15 minutes of scrapes
EVAL_TIME = "10m"


def _run(args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)


def _ok(proc: subprocess.CompletedProcess) -> bool:
    return proc.returncode == 0


def _explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def test_prometheus_config_is_valid(promtool):
    proc = _run([promtool, "check", "config", str(PROM_DIR / "prometheus.yml")])
    assert _ok(proc), _explain(proc)
    assert "SUCCESS" in proc.stdout


def test_rules_are_valid(promtool):
    proc = _run([promtool, "check", "rules", str(PROM_DIR / "rules.yml")])
    assert _ok(proc), _explain(proc)


def test_rules_unit_tests_pass(promtool):
    proc = _run([promtool, "test", "rules", "rules_test.yml"], cwd=PROM_DIR)
    assert _ok(proc), _explain(proc)
    assert "SUCCESS" in proc.stdout + proc.stderr


def _queries(panel_queries, rule_queries, dashboards):
    return [(q, query_as_promql(q, dashboards)) for q in [*panel_queries, *rule_queries]]


def test_every_query_parses(promtool, panel_queries, rule_queries, dashboards, tmp_path):
    """promtool has no offline `query`; `check rules` parses each expr of a rules file."""
    queries = _queries(panel_queries, rule_queries, dashboards)
    rules = {
        "groups": [
            {
                "name": "dashboard_queries",
                "rules": [{"record": f"dashboard:query_{i}", "expr": expr} for i, (_, expr) in enumerate(queries)],
            }
        ]
    }
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    proc = _run([promtool, "check", "rules", str(path)])
    assert _ok(proc), (
        _explain(proc) + "\n" + "\n".join(f"query_{i}: {q.source}: {expr}" for i, (q, expr) in enumerate(queries))
    )
    assert f"SUCCESS: {len(queries)} rules found" in proc.stdout


def _input_series(exporter_series) -> list[dict]:
    """The exporter's samples as promtool input: counters and histogram parts grow at a steady
    rate (what they recorded, per scrape), gauges hold their value."""
    out = []
    for s in exporter_series:
        labels = ",".join(f'{k}="{v}"' for k, v in s.labels)
        grows = s.family_type in {"counter", "histogram"}
        values = f"0+{s.value:g}x{SAMPLES}" if grows else f"{s.value:g}x{SAMPLES}"
        out.append({"series": f"{s.name}{{{labels}}}", "values": values})
    return out


def test_every_query_returns_data_per_rank_from_the_exporters_series(
    promtool, panel_queries, rule_queries, dashboards, exporter_series, tmp_path
):
    """Each dashboard query, evaluated on the exporter's real series of a 2-rank job, must return
    one or more series for each rank (so names, labels, grouping and `$rank`/`$job` expansion are
    all right); each variable query must list values; each rule expr must evaluate to a vector
    (alerts may legitimately be empty)."""
    tests = []
    queries = _queries(panel_queries, rule_queries, dashboards)
    for q, expr in queries:
        if q.kind == "panel":
            tests.append(
                {
                    "expr": f"count(count by (fsdp_rank) ({expr}))",
                    "eval_time": EVAL_TIME,
                    "exp_samples": [{"labels": "{}", "value": len(RANKS)}],
                }
            )
        elif q.kind == "variable":
            tests.append(
                {
                    "expr": f"clamp_max(count({expr}), 1)",
                    "eval_time": EVAL_TIME,
                    "exp_samples": [{"labels": "{}", "value": 1}],
                }
            )
    rules_file = tmp_path / "empty_rules.yml"
    rules_file.write_text("groups: []\n")
    suite = {
        "rule_files": [rules_file.name],
        "evaluation_interval": SCRAPE_INTERVAL,
        "tests": [
            {"interval": SCRAPE_INTERVAL, "input_series": _input_series(exporter_series), "promql_expr_test": tests}
        ],
    }
    path = tmp_path / "queries_test.yml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False, width=10_000))
    assert len(tests) == len([q for q, _ in queries if q.kind in {"panel", "variable"}]) >= 15
    proc = _run([promtool, "test", "rules", path.name], cwd=tmp_path)
    assert _ok(proc), _explain(proc) + "\nqueries:\n" + "\n".join(f"{q.source}: {expr}" for q, expr in queries)


def test_rule_exprs_evaluate_on_the_exporters_series(promtool, rule_queries, exporter_series, tmp_path):
    """Recording rules give one series per rank from the exporter's series; alert exprs evaluate
    (the fixture's counters are all non-zero, so every alert but the lost-update one — gauge 0.5 —
    matches)."""
    tests = []
    for q in rule_queries:
        if q.source.split(": ")[1].startswith("Fsdp"):
            expected = 0 if "lost_ratio" in q.expr else len(RANKS)
            expr = f"count(count by (fsdp_rank) ({q.expr})) or vector(0)"
        else:
            expected, expr = len(RANKS), f"count(count by (fsdp_rank) ({q.expr}))"
        tests.append({"expr": expr, "eval_time": EVAL_TIME, "exp_samples": [{"labels": "{}", "value": expected}]})
    (tmp_path / "empty_rules.yml").write_text("groups: []\n")
    suite = {
        "rule_files": ["empty_rules.yml"],
        "evaluation_interval": SCRAPE_INTERVAL,
        "tests": [
            {"interval": SCRAPE_INTERVAL, "input_series": _input_series(exporter_series), "promql_expr_test": tests}
        ],
    }
    path = tmp_path / "rules_exprs_test.yml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False, width=10_000))
    proc = _run([promtool, "test", "rules", path.name], cwd=tmp_path)
    assert _ok(proc), _explain(proc)


def test_rejected_mismatches_stat_reads_zero_in_a_healthy_run(
    promtool, panel_queries, dashboards, exporter_series, tmp_path
):
    """A run that rejected nothing has no `rejected` series at all; the stat panel must still show
    0 for every rank, not "No data" (which reads as a broken dashboard)."""
    (panel,) = [q for q in panel_queries if "'Rejected dtype mismatches'" in q.source]
    healthy = [s for s in exporter_series if dict(s.labels).get("fsdp_mismatch_action") != semconv.MISMATCH_REJECTED]
    assert len(healthy) < len(exporter_series), "the fixture should hold rejected series to leave out"
    expr = query_as_promql(panel, dashboards)
    test = {
        "expr": expr,
        "eval_time": EVAL_TIME,
        "exp_samples": [{"labels": f'{{fsdp_rank="{rank}"}}', "value": 0} for rank in RANKS],
    }
    (tmp_path / "empty_rules.yml").write_text("groups: []\n")
    suite = {
        "rule_files": ["empty_rules.yml"],
        "evaluation_interval": SCRAPE_INTERVAL,
        "tests": [{"interval": SCRAPE_INTERVAL, "input_series": _input_series(healthy), "promql_expr_test": [test]}],
    }
    path = tmp_path / "healthy_test.yml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False, width=10_000))
    proc = _run([promtool, "test", "rules", path.name], cwd=tmp_path)
    assert _ok(proc), f"want 0 for ranks {RANKS} from {expr!r}; promtool says:\n" + _explain(proc)
