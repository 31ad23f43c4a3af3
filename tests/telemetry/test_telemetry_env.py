"""FSDP_PATCH_* parsing, and the promise that telemetry-off never imports OpenTelemetry."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from fsdp_patch.telemetry import env, telemetry_enabled
from telemetry_testing import fake_optimizer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, False),
        ("", False),
        ("0", False),
        ("false", False),
        ("FALSE", False),
        (" False ", False),
        ("1", True),
        ("true", True),
        ("True", True),
        ("TRUE", True),
    ],
)
def test_telemetry_enabled_accepts_documented_values(monkeypatch, value, expected):
    if value is not None:
        monkeypatch.setenv("FSDP_PATCH_TELEMETRY", value)
    assert telemetry_enabled() is expected


@pytest.mark.parametrize("value", ["yes", "2", "on", "tru", "-1"])
def test_telemetry_enabled_rejects_other_values_naming_variable_value_and_choices(monkeypatch, value):
    monkeypatch.setenv("FSDP_PATCH_TELEMETRY", value)
    named = ("FSDP_PATCH_TELEMETRY", repr(value), "'1'", "'false'")  # the variable, its value, the choices
    with pytest.raises(ValueError, match="(?s)" + "".join(f"(?=.*{re.escape(n)})" for n in named)):
        telemetry_enabled()


def test_precision_every_default_and_values(monkeypatch):
    assert env.precision_every() == env.DEFAULT_PRECISION_EVERY == 100
    monkeypatch.setenv("FSDP_PATCH_PRECISION_EVERY", "0")
    assert env.precision_every() == 0
    monkeypatch.setenv("FSDP_PATCH_PRECISION_EVERY", " 25 ")
    assert env.precision_every() == 25


@pytest.mark.parametrize("value", ["-1", "1.5", "ten", "1e3"])
def test_precision_every_rejects_malformed(monkeypatch, value):
    monkeypatch.setenv("FSDP_PATCH_PRECISION_EVERY", value)
    with pytest.raises(ValueError, match="FSDP_PATCH_PRECISION_EVERY.*non-negative integer"):
        env.precision_every()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", None),
        ("all", None),
        ("ALL", None),
        ("none", frozenset()),
        ("0,3", frozenset({0, 3})),
        ("0-2, 5", frozenset({0, 1, 2, 5})),
        ("7", frozenset({7})),
    ],
)
def test_trace_ranks(monkeypatch, value, expected):
    monkeypatch.setenv("FSDP_PATCH_TRACE_RANKS", value)
    assert env.trace_ranks() == expected


@pytest.mark.parametrize("value", ["a", "3-1", "-1", "0,,1", "1-"])
def test_trace_ranks_rejects_malformed(monkeypatch, value):
    monkeypatch.setenv("FSDP_PATCH_TRACE_RANKS", value)
    with pytest.raises(ValueError, match="FSDP_PATCH_TRACE_RANKS.*'all', 'none'"):
        env.trace_ranks()


def test_summary_and_flush_timeout(monkeypatch):
    assert env.summary_mode() == "rank0"
    monkeypatch.setenv("FSDP_PATCH_SUMMARY", "All")
    assert env.summary_mode() == "all"
    monkeypatch.setenv("FSDP_PATCH_SUMMARY", "rank1")
    with pytest.raises(ValueError, match="FSDP_PATCH_SUMMARY.*'rank0', 'all', 'none'"):
        env.summary_mode()
    assert env.flush_timeout_s() == env.DEFAULT_FLUSH_TIMEOUT_S
    monkeypatch.setenv("FSDP_PATCH_FLUSH_TIMEOUT", "2.5")
    assert env.flush_timeout_s() == 2.5
    for bad in ("0", "-1", "inf", "soon"):
        monkeypatch.setenv("FSDP_PATCH_FLUSH_TIMEOUT", bad)
        with pytest.raises(ValueError, match="FSDP_PATCH_FLUSH_TIMEOUT"):
            env.flush_timeout_s()


def test_trace_dir_default_is_relative(monkeypatch):
    monkeypatch.delenv("FSDP_PATCH_TRACE_DIR")
    assert env.trace_dir() == "fsdp_patch_traces"
    assert not os.path.isabs(env.trace_dir())


def test_observer_fails_fast_on_a_malformed_variable(monkeypatch):
    from fsdp_patch.telemetry import OptimizerObserver

    monkeypatch.setenv("FSDP_PATCH_TRACE_RANKS", "first")
    with pytest.raises(ValueError, match="FSDP_PATCH_TRACE_RANKS"):
        OptimizerObserver(fake_optimizer(), precision_aware=False)


def test_telemetry_off_path_imports_no_opentelemetry():
    code = (
        "import sys\nimport fsdp_patch.telemetry as telemetry\n"
        "assert telemetry.telemetry_enabled() is False\n"
        "telemetry.PrecisionView\n"
        "telemetry.shutdown()\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'opentelemetry')\n"
        "assert not loaded, loaded\n"
        "print('clean')\n"
    )
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_PATCH_", "OTEL_"))}
    environment["PYTHONPATH"] = REPO_ROOT + os.pathsep + environment.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "clean"


@pytest.mark.parametrize(
    ("value", "want"), [(None, None), ("bf16", "bfloat16"), ("Float16", "float16"), ("fp32", "float32")]
)
def test_compute_dtype(monkeypatch, value, want):
    if value is not None:
        monkeypatch.setenv("FSDP_PATCH_COMPUTE_DTYPE", value)
    assert env.compute_dtype() == want


def test_compute_dtype_rejects_other_values(monkeypatch):
    monkeypatch.setenv("FSDP_PATCH_COMPUTE_DTYPE", "int8")
    with pytest.raises(ValueError, match="FSDP_PATCH_COMPUTE_DTYPE='int8'.*'bfloat16'"):
        env.compute_dtype()


def test_prometheus_final_scrape_settings(monkeypatch):
    assert env.prometheus_final_scrapes() is None, "unset: decided by whether the endpoint was scraped"
    assert env.prometheus_final_scrape_timeout_s() == env.DEFAULT_PROMETHEUS_FINAL_SCRAPE_TIMEOUT_S
    monkeypatch.setenv("FSDP_PATCH_PROMETHEUS_FINAL_SCRAPES", "3")
    monkeypatch.setenv("FSDP_PATCH_PROMETHEUS_FINAL_SCRAPE_TIMEOUT", "90")
    got = (env.prometheus_final_scrapes(), env.prometheus_final_scrape_timeout_s())
    assert got == (3, 90.0), f"want (3, 90.0), got {got}"
    monkeypatch.setenv("FSDP_PATCH_PROMETHEUS_FINAL_SCRAPES", "0")
    assert env.prometheus_final_scrapes() == 0
    for bad in ("-1", "one", "1.5"):
        monkeypatch.setenv("FSDP_PATCH_PROMETHEUS_FINAL_SCRAPES", bad)
        with pytest.raises(ValueError, match="FSDP_PATCH_PROMETHEUS_FINAL_SCRAPES='.*'.*non-negative integer"):
            env.validate_all()
    monkeypatch.setenv("FSDP_PATCH_PROMETHEUS_FINAL_SCRAPES", "1")
    for bad in ("0", "inf", "soon"):
        monkeypatch.setenv("FSDP_PATCH_PROMETHEUS_FINAL_SCRAPE_TIMEOUT", bad)
        with pytest.raises(ValueError, match="FSDP_PATCH_PROMETHEUS_FINAL_SCRAPE_TIMEOUT='.*'.*positive, finite"):
            env.validate_all()


def test_origin_and_escalation_settings(monkeypatch):
    assert (env.precision_origin(), env.precision_escalation()) == (True, env.DEFAULT_PRECISION_ESCALATION)
    monkeypatch.setenv("FSDP_PATCH_PRECISION_ORIGIN", "Off")
    monkeypatch.setenv("FSDP_PATCH_PRECISION_ESCALATION", "0")
    assert (env.precision_origin(), env.precision_escalation()) == (False, 0)
    monkeypatch.setenv("FSDP_PATCH_PRECISION_ORIGIN", "maybe")
    with pytest.raises(ValueError, match="FSDP_PATCH_PRECISION_ORIGIN='maybe'.*'on', 'off'"):
        env.validate_all()
    monkeypatch.setenv("FSDP_PATCH_PRECISION_ORIGIN", "on")
    monkeypatch.setenv("FSDP_PATCH_PRECISION_ESCALATION", "-2")
    with pytest.raises(ValueError, match="FSDP_PATCH_PRECISION_ESCALATION='-2'.*non-negative integer"):
        env.validate_all()
