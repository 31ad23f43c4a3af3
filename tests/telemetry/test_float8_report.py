"""The precision report on the float8 cast watch's events (``offline.float8_report``), from trace
files the real exporter writes with events as the watch makes them (``float8_watch.event_attributes``
of its rows) on 2 ranks: an outlier feature in a layer's input leads the findings with float8_flush,
naming that input and advising bf16 for the layer; an outlier token advises rowwise scaling; a layer
already scaled per row, or left subnormal rather than flushed, is advised as measured; a healthy run
has no float8 finding, and the JSON's "float8" section holds each module and role with its scale at
every step reported, the worst of the ranks.
"""

from __future__ import annotations

import math
from pathlib import Path

from fsdp_patch.telemetry import float8_thresholds, semconv
from fsdp_patch.telemetry.instrumentation.float8_watch import CastRow, event_attributes
from fsdp_patch.telemetry.offline import precision_report
from report_traces import HEALTHY, rank_tracer

FIRST, MIDDLE, PLANTED, LAST = "tok_proj", "layers.0.mlp.fc1", "layers.1.mlp.fc1", "output"
STEPS = (1, 2, 3)
# What the watch measures of a Gaussian bf16 tensor (tests/telemetry/test_float8_casts.py).
GAUSSIAN = {
    "amax": 4.09,
    "scale": 109.4,
    "scale_max": 109.4,
    "amax_ratio": 6.0,
    "flushed": 0.0,
    "subnormal": 0.0,
    "saturated": 0.0,
    "sqnr": 31.6,
    "nonfinite": 0.0,
    "rowwise_flushed": 0.0,
}
# An input with one column at 1e6 (a feature), and with one row at 1e6 (a token), as measured there.
OUTLIER_FEATURE = {**GAUSSIAN, "amax": 999424.0, "scale": 4.5e-4, "scale_max": 4.5e-4, "amax_ratio": 1.44e6}
OUTLIER_FEATURE.update(flushed=0.954, subnormal=0.984, sqnr=102.4, rowwise_flushed=0.954)
OUTLIER_TOKEN = {**OUTLIER_FEATURE, "flushed": 0.962, "subnormal": 0.992, "rowwise_flushed": 0.0}
FLOAT8_CHECKS = {t.check for t in float8_thresholds.FLOAT8_CHECKS}


def row(module: str, role: str, values: dict[str, float], position: str = "middle", **kind: object) -> CastRow:
    dtype = "float8_e5m2" if role == semconv.FLOAT8_ROLE_GRAD_OUTPUT else "float8_e4m3fn"
    return CastRow(
        module,
        role,
        str(kind.get("dtype", dtype)),
        str(kind.get("granularity", "tensorwise")),
        bool(kind.get("gathered", False)),
        values,
        1,
        position,
    )


def healthy_rows(step: int, rank: int, modules: tuple[str, ...] = (MIDDLE, PLANTED)) -> list[CastRow]:
    """Each module's three casts, Gaussian; the scale falling by a tenth a step, rank 1's 1% lower."""
    scale = GAUSSIAN["scale"] * 0.9 ** (step - 1) * (1 - 0.01 * rank)
    return [
        row(m, role, {**GAUSSIAN, "scale": scale, "scale_max": scale}) for m in modules for role in semconv.FLOAT8_ROLES
    ]


def write_trace(directory: Path, rows_of: object) -> None:
    """Steps 1-4 on 2 ranks, 1-3 diagnosed; ``rows_of(step, rank)``'s events on the span of the
    next step, as the watch reads each step's casts at the next one's end."""
    for rank in range(2):
        provider, tracer = rank_tracer(directory, rank, 2)
        for step in range(1, len(STEPS) + 2):
            with tracer.start_as_current_span(semconv.SPAN_STEP, attributes={semconv.ATTR_STEP: step}) as span:
                if step in STEPS:
                    with tracer.start_as_current_span(semconv.SPAN_PRECISION) as child:
                        child.set_attributes(HEALTHY)
                if step - 1 in STEPS:
                    for cast in rows_of(step - 1, rank):  # type: ignore[operator]
                        span.add_event(semconv.EVENT_FLOAT8_CAST, event_attributes(cast, step - 1, rank))
        provider.shutdown()


def float8_findings(directory: Path) -> list[dict]:
    data = precision_report.report_json(str(directory))
    return [f for f in data["findings"] if f["check"] in FLOAT8_CHECKS]


def planted(values: dict[str, float], role: str = semconv.FLOAT8_ROLE_INPUT, **kind: object) -> object:
    """Healthy casts with the first and last modules in float8 too; from step 2 on, ``PLANTED``'s
    ``role`` cast with ``values``."""

    def rows_of(step: int, rank: int) -> list[CastRow]:
        rows = [row(FIRST, r, GAUSSIAN, semconv.FLOAT8_POSITION_FIRST) for r in semconv.FLOAT8_ROLES] + healthy_rows(
            step, rank
        )
        rows += [row(LAST, r, GAUSSIAN, semconv.FLOAT8_POSITION_LAST) for r in semconv.FLOAT8_ROLES]
        if step >= 2:
            rows = [row(PLANTED, role, values, **kind) if (c.module, c.role) == (PLANTED, role) else c for c in rows]
        return rows

    return rows_of


def test_an_outlier_feature_leads_with_float8_flush_naming_the_input_and_advising_bf16(tmp_path: Path) -> None:
    write_trace(tmp_path, planted(OUTLIER_FEATURE))
    found = float8_findings(tmp_path)
    got = [(f["check"], f["severity"], f["first_step"]) for f in found]
    want = [("float8_flush", "problem", 2), ("float8_sensitive_layer", "warning", 1)]
    assert got == want, f"want the flush first, then the first and last layers, got {got}"
    flush = found[0]
    assert flush["finding"].endswith(f": {PLANTED}'s input"), f"want the planted input named, got {flush['finding']}"
    assert f"Keep {PLANTED} in bf16 (module_filter_fn=lambda module, fqn: fqn != '{PLANTED}'" in flush["advice"], (
        f"an outlier in every row: want bf16 for the layer, got {flush['advice']}"
    )
    assert "rowwise" not in flush["advice"].replace("would flush as much", ""), f"not rowwise: {flush['advice']}"
    assert flush["details"][0].startswith(f"{PLANTED}'s input, step 2: tensorwise float8_e4m3fn; amax 9.994e+05"), (
        f"want the cast's line first, got {flush['details']}"
    )
    layers = found[1]["finding"]
    assert layers.endswith(f": {FIRST} (first), {LAST} (last)"), f"want the first and last named, got {layers}"
    text = precision_report.report(str(tmp_path))
    assert (
        f"a float8 cast flushes most of a layer's input or weight to zero: one outlier sets the scale: {PLANTED}'s input (first at step 2)"
        in text
    ), text


def test_an_outlier_token_advises_rowwise_scaling(tmp_path: Path) -> None:
    write_trace(tmp_path, planted(OUTLIER_TOKEN))
    (flush,) = [f for f in float8_findings(tmp_path) if f["check"] == "float8_flush"]
    want = "a scale per row would flush 0% of layers.1.mlp.fc1's input, not 96.2%"
    assert flush["advice"].startswith(want), f"want {want!r}, got {flush['advice']}"
    assert "Float8LinearConfig.from_recipe_name('rowwise')" in flush["advice"], flush["advice"]


def test_a_layer_already_scaled_per_row_is_advised_bf16_not_rowwise(tmp_path: Path) -> None:
    values = {**OUTLIER_FEATURE, "rowwise_flushed": math.nan}
    write_trace(tmp_path, planted(values, granularity="axiswise"))
    (flush,) = [f for f in float8_findings(tmp_path) if f["check"] == "float8_flush"]
    assert "?" not in flush["advice"] and "from_recipe_name('rowwise')" not in flush["advice"], flush["advice"]
    assert f"Keep {PLANTED} in bf16" in flush["advice"], f"want bf16 for the layer, got {flush['advice']}"


def test_a_cast_left_subnormal_is_a_warning_advised_from_its_amax_ratio(tmp_path: Path) -> None:
    values = {**GAUSSIAN, "amax_ratio": 3000.0, "flushed": 0.02, "subnormal": 0.7, "rowwise_flushed": 0.0}
    write_trace(tmp_path, planted(values))
    (flush,) = [f for f in float8_findings(tmp_path) if f["check"] == "float8_flush"]
    assert flush["severity"] == "warning", f"subnormal, not flushed: want a warning, got {flush['severity']}"
    assert "would flush as much" not in flush["advice"], f"nothing flushed to compare: {flush['advice']}"
    assert "70%" in flush["advice"] and "3e+03x" in flush["advice"], f"want the share and ratio: {flush['advice']}"


def test_a_stale_gathered_scale_advises_recomputing_it_after_each_step(tmp_path: Path) -> None:
    values = {**GAUSSIAN, "saturated": 0.3, "sqnr": math.inf, "rowwise_flushed": math.nan}
    write_trace(tmp_path, planted(values, semconv.FLOAT8_ROLE_WEIGHT, gathered=True))
    (saturation,) = [f for f in float8_findings(tmp_path) if f["check"] == "float8_saturation"]
    assert saturation["finding"].endswith(f": {PLANTED}'s weight"), saturation["finding"]
    assert "precompute_float8_dynamic_scale_for_fsdp" in saturation["advice"], saturation["advice"]
    assert ", gathered in float8;" in saturation["details"][0], saturation["details"]


def test_a_zero_layer_without_an_amax_floor_is_named_with_its_zeros(tmp_path: Path) -> None:
    values = {**GAUSSIAN, "amax": 0.0, "scale": math.inf, "scale_max": math.inf, "amax_ratio": math.nan}
    values.update(sqnr=math.nan, nonfinite=1280.0)
    write_trace(tmp_path, planted(values, semconv.FLOAT8_ROLE_WEIGHT))
    found = float8_findings(tmp_path)
    assert found[0]["check"] == "float8_nonfinite", f"want the non-finite scale first, got {found}"
    assert found[0]["advice"].startswith(f"{PLANTED}'s weight is all zeros (amax 0), and its scale inf"), found[0]


def test_a_healthy_run_has_no_float8_finding_and_its_json_holds_every_cast_s_scale_trend(tmp_path: Path) -> None:
    write_trace(tmp_path, healthy_rows)
    data = precision_report.report_json(str(tmp_path))
    found = [f["check"] for f in data["findings"] if f["check"] in FLOAT8_CHECKS]
    assert found == [], f"want no float8 finding, got {found}"
    got = {(c["module"], c["role"]): c for c in data["float8"]}
    want_keys = {(m, r) for m in (MIDDLE, PLANTED) for r in semconv.FLOAT8_ROLES}
    assert set(got) == want_keys, f"want each module and role once, got {sorted(got)}"
    for key, cast in got.items():
        # rank 1's scale is the lower: the worst of the ranks
        want_trend = [[step, GAUSSIAN["scale"] * 0.9 ** (step - 1) * 0.99] for step in STEPS]
        trend = cast["scale_trend"]
        assert [s for s, _ in trend] == list(STEPS), f"{key}: want steps {STEPS}, got {trend}"
        assert all(math.isclose(a[1], b[1], rel_tol=1e-6) for a, b in zip(trend, want_trend, strict=True)), (
            f"{key}: want the lower rank's scale each step {want_trend}, got {trend}"
        )
        assert (cast["step"], cast["ranks"], cast["sqnr"]) == (3, [0, 1], GAUSSIAN["sqnr"]), f"{key}: {cast}"
