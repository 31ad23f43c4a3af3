"""Per-parameter findings from reduced rows (attribution), the dtype-contract audit, and what the
observer puts on the spans and metrics, on hand-made rows and groups."""

from __future__ import annotations

import pytest
import torch
from fsdp_patch.telemetry import env, semconv
from fsdp_patch.telemetry.diagnostics import attribution, dtype_contract
from fsdp_patch.telemetry.diagnostics import rows as ps
from fsdp_patch.telemetry.diagnostics.optimizer_state import ParamContext
from fsdp_patch.telemetry.diagnostics.rows import ParamSlot
from telemetry_testing import Group, run_fake_step

BF16, FP32 = torch.bfloat16, torch.float32


def slot(name: str, unit: str = "", compute: torch.dtype | None = BF16) -> ParamSlot:
    return ParamSlot(name, unit, None, 0, 0, 0, 10, compute, FP32)


def row(**values: float) -> list[float]:
    out = [0.0] * ps.ROW
    out[ps.NUMEL] = 10.0
    for key, value in values.items():
        out[getattr(ps, key.upper())] = value
    return out


def healthy(**extra: float) -> list[float]:
    return row(changed=10, lost=1, grad_amax=0.5, main_sq=4.0, diff_sq=4e-6, update_sq=4e-2, **extra)


def no_ranks(slot: int, slots) -> tuple[int, ...]:
    raise AssertionError("ranks read although nothing is non-finite")


def offenders(findings: attribution.StepFindings, diagnostic: str) -> list[tuple[int, float]]:
    return [(o.slot, o.value) for o in findings.offenders if o.diagnostic == diagnostic]


def test_first_nonfinite_is_the_grad_before_the_state_and_weights_and_recorded_once() -> None:
    table = [slot("a"), slot("b", "blocks.0"), slot("c")]
    rows = [row(main_nan=1, compute_nan=1, state_nan=1), row(grad_inf=2, main_nan=2), healthy()]
    contexts = [ParamContext(state_keys=("exp_avg",))] * 3
    asked = []

    def ranks_of(i: int, slots) -> tuple[int, ...]:
        asked.append((i, tuple(slots)))
        return (3,)

    tracker = attribution.Attribution(top_k=2, window=3)
    first = tracker.analyze(7, table, rows, contexts, ranks_of).first_nonfinite
    want = attribution.FirstNonfinite(7, semconv.TENSOR_MAIN_GRAD, None, (1,), (3,), 0, 2)
    assert first == want, f"want {want}, got {first}"
    assert asked == [(1, (ps.GRAD_NAN, ps.GRAD_INF))]
    again = tracker.analyze(8, table, rows, contexts, ranks_of)
    assert again.first_nonfinite is None and tracker.first_nonfinite == want, "recorded once per run"


def test_state_comes_before_the_weight_it_makes_nan() -> None:
    table = [slot("a"), slot("b")]
    rows = [row(main_nan=1), row()]
    rows[1][ps.STATE_INF + 2] = 4  # b's second state tensor
    contexts = [ParamContext(), ParamContext(state_keys=("exp_avg", "exp_avg_sq"))]
    first = attribution.Attribution(3, 3).analyze(2, table, rows, contexts, lambda i, s: (0, 1)).first_nonfinite
    assert (first.tensor, first.state_key, first.slots, first.ranks, first.inf) == (
        semconv.TENSOR_OPTIMIZER_STATE,
        "exp_avg_sq",
        (1,),
        (0, 1),
        4,
    ), first


def test_offenders_are_the_top_k_worst_first_and_only_what_has_a_value() -> None:
    table = [slot(n) for n in "abcd"]
    rows = [
        healthy(),
        row(changed=10, lost=10, grad_amax=0.1, main_sq=1.0, update_sq=1e-12),
        row(changed=4, lost=2, grad_amax=2.0, main_sq=1.0, update_sq=1e-9),
        healthy(),
    ]
    rows[3][ps.LOST] = 9
    findings = attribution.Attribution(top_k=2, window=3).analyze(1, table, rows, [ParamContext()] * 4, no_ranks)
    assert offenders(findings, semconv.METRIC_LOST_RATIO) == [(1, 1.0), (3, 0.9)]
    assert offenders(findings, semconv.METRIC_GRAD_AMAX) == [(2, 2.0), (0, 0.5)]
    resolution = offenders(findings, semconv.DIAGNOSTIC_UPDATE_RESOLUTION)
    u = 2.0**-8
    assert [i for i, _ in resolution] == [1, 2], resolution  # the smallest first, only those below 1
    assert resolution[0][1] == pytest.approx(1e-6 / u) and resolution[1][1] == pytest.approx(math_sqrt(1e-9) / u)
    assert offenders(findings, semconv.METRIC_NONFINITE) == [], "nothing non-finite, nothing named"


def math_sqrt(x: float) -> float:
    return x**0.5


# bfloat16's rounding step at a weight's RMS (main_sq=1.0 over the row): its unit roundoff.
BF16_U = 2.0**-8


def test_stuck_needs_the_window_and_resets() -> None:
    table = [slot("norm.weight"), slot("fp32.weight", compute=None)]
    # An update 1e-4 of the rounding step: it would take some 10000 steps of one sign to move.
    tiny = (1e-4 * BF16_U) ** 2
    stuck = [
        row(changed=10, lost=10, grad_amax=1.0, main_sq=1.0, update_sq=tiny),
        row(changed=10, lost=0, grad_amax=1.0, main_sq=1.0),
    ]
    moving = [row(changed=10, lost=9, grad_amax=1.0, main_sq=1.0, update_sq=tiny), stuck[1]]
    tracker = attribution.Attribution(top_k=3, window=3)
    contexts = [ParamContext()] * 2
    counts = [
        tracker.analyze(s, table, r, contexts, no_ranks)
        for s, r in enumerate([stuck, stuck, stuck, stuck, moving, stuck], 1)
    ]
    got = [(f.stuck, offenders(f, semconv.DIAGNOSTIC_STUCK)) for f in counts]
    want = [(0, []), (0, []), (1, [(0, 3.0)]), (1, [(0, 4.0)]), (0, []), (0, [])]
    assert got == want, f"want {want}, got {got}"


def test_a_compute_copy_lagging_its_fp32_master_is_never_stuck() -> None:
    """A bfloat16 weight near 1.0 at a learning rate of 2e-4: its update is a twentieth of the
    rounding step, so the compute copy moves once in some 20 steps while the master accumulates;
    every step between lost all of its (tiny) change, which is what master weights are for."""
    table = [slot("norm.weight")]
    lagging = [row(changed=10, lost=10, grad_amax=1.0, main_sq=1.0, update_sq=(0.05 * BF16_U) ** 2)]
    tracker = attribution.Attribution(top_k=3, window=3)
    found = [tracker.analyze(s, table, lagging, [ParamContext()], no_ranks) for s in range(1, 11)]
    got = [(f.stuck, offenders(f, semconv.DIAGNOSTIC_STUCK)) for f in found]
    assert got == [(0, [])] * 10, f"a lagging compute copy was named stuck: {got}"
    crawling = [row(changed=10, lost=10, grad_amax=1.0, main_sq=1.0, update_sq=(0.9e-3 * BF16_U) ** 2)]
    tracker = attribution.Attribution(top_k=3, window=3)
    found = [tracker.analyze(s, table, crawling, [ParamContext()], no_ranks) for s in range(1, 4)]
    assert found[-1].stuck == 1, "an update below 1e-3 of the rounding step, for the window: stuck"


def test_unstepped_names_the_cause_and_spares_an_lr_of_zero() -> None:
    table = [slot("left.out"), slot("frozen.lr"), slot("copy")]
    rows = [row(grad_amax=1.0), row(grad_amax=1.0), row(grad_amax=1.0)]
    contexts = [ParamContext(in_optimizer=False), ParamContext(lr=0.0), ParamContext(lr=1e-3)]
    tracker = attribution.Attribution(top_k=5, window=2)
    tracker.analyze(1, table, rows, contexts, no_ranks)
    findings = tracker.analyze(2, table, rows, contexts, no_ranks)
    got = [(o.slot, o.value, o.cause) for o in findings.offenders if o.diagnostic == semconv.DIAGNOSTIC_UNSTEPPED]
    assert got == [(0, 2.0, semconv.UNSTEPPED_NOT_IN_OPTIMIZER), (2, 2.0, semconv.UNSTEPPED_NO_UPDATE)], got
    assert findings.unstepped == 2
    assert findings.skipped, "nothing the optimizer steps changed, grads non-zero and finite"


def test_a_skipped_step_needs_finite_grads() -> None:
    table = [slot("a")]
    nan_grads = [row(grad_amax=ps.GRAD_AMAX_NONFINITE, grad_nan=3)]
    findings = attribution.Attribution(3, 3).analyze(1, table, nan_grads, [ParamContext()], lambda i, s: (0,))
    assert not findings.skipped, "a step skipped for NaN grads (a loss scaler) is the NaN finding, not a silent skip"
    moving = attribution.Attribution(3, 3).analyze(1, table, [healthy()], [ParamContext()], no_ranks)
    assert not moving.skipped


NAN_GRAD = {"grad_amax": ps.GRAD_AMAX_NONFINITE, "grad_nan": 3}
STEPPED, NOT_HELD = ParamContext(lr=1e-3), ParamContext(in_optimizer=False)


@pytest.mark.parametrize(
    ("grads", "contexts", "want"),
    [
        # A loss scaler skips the whole step when any grad it holds is NaN/Inf: the NaN finding
        # explains it, whichever parameter holds the NaN.
        ((NAN_GRAD, {"grad_amax": 0.5}), (STEPPED, STEPPED), False),
        (({"grad_amax": 0.5}, NAN_GRAD), (STEPPED, STEPPED), False),
        # Finite grads everywhere and nothing moved: silent.
        (({"grad_amax": 0.5}, {"grad_amax": 0.2}), (STEPPED, STEPPED), True),
        # The NaN is in a parameter no optimizer holds, so nothing the step reads explains the skip.
        ((NAN_GRAD, {"grad_amax": 0.5}), (NOT_HELD, STEPPED), True),
        # Grads all zero: no update to apply, nothing skipped.
        (({"grad_amax": 0.0}, {"grad_amax": 0.0}), (STEPPED, STEPPED), False),
    ],
    ids=["nan_first", "nan_second", "all_finite", "nan_not_held", "zero_grads"],
)
def test_a_step_with_finite_and_nonfinite_grads_is_skipped_silently_only_without_a_held_nan(
    grads: tuple[dict[str, float], dict[str, float]], contexts: tuple[ParamContext, ParamContext], want: bool
) -> None:
    """Two parameters, no main weight changed: a silent skip only if every grad the optimizer
    steps is finite and some is non-zero."""
    table = [slot("a"), slot("b")]
    rows = [row(**values) for values in grads]
    findings = attribution.Attribution(3, 3).analyze(1, table, rows, list(contexts), lambda i, s: (0,))
    assert findings.skipped is want, (
        f"grads {grads}, held {[c.in_optimizer for c in contexts]}: skipped {findings.skipped}, want {want}"
    )


def test_units_sum_their_parameters() -> None:
    table = [slot("a", "blocks.0"), slot("b", "blocks.0"), slot("c")]
    rows = [row(changed=4, lost=1, grad_amax=0.5, overflow=2), row(changed=6, lost=5, grad_amax=0.9), row(changed=1)]
    units = attribution.unit_rows(table, rows)
    assert list(units) == ["blocks.0", ""]
    stats = attribution.stats_of_row(units["blocks.0"])
    assert (stats.changed, stats.lost, stats.overflow, stats.grad_amax) == (10, 6, 2, 0.9), stats


# -- the dtype-contract audit -------------------------------------------------------------------


def test_audit_names_optimizer_state_in_another_dtype() -> None:
    p = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    assert dtype_contract.audit_dtypes(optimizer) == []
    optimizer.state[p]["momentum_buffer"] = torch.zeros(4, dtype=BF16)
    optimizer.state[p]["step"] = torch.tensor(3.0)  # 0-d: not a per-element state tensor
    (violation,) = dtype_contract.audit_dtypes(optimizer)
    want = dtype_contract.ContractViolation(
        "param_groups[0]['params'][0]", "", semconv.TENSOR_OPTIMIZER_STATE, "momentum_buffer", FP32, BF16
    )
    assert violation == want, f"want {want}, got {violation}"


def test_observer_audits_at_the_first_step_after_a_load_and_names_each_violation_once(otel, make_observer, monkeypatch):
    monkeypatch.setenv("FSDP_PATCH_PRECISION_EVERY", "0")
    p = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    optimizer.state[p]["momentum_buffer"] = torch.zeros(4, dtype=BF16)
    observer = make_observer(optimizer)
    group = Group(torch.zeros(4), torch.zeros(4, dtype=BF16), None)
    for _ in range(3):
        run_fake_step(observer, [group], [torch.zeros(4)])
    state = optimizer.state_dict()
    optimizer.load_state_dict(state)  # casts the state to the parameter's dtype ...
    optimizer.state[p]["momentum_buffer"] = torch.zeros(4, dtype=torch.float16)  # ... which is then replaced
    run_fake_step(observer, [group], [torch.zeros(4)])  # after a load: audited
    optimizer.state[p]["momentum_buffer"] = torch.zeros(4, dtype=torch.float64)
    run_fake_step(observer, [group], [torch.zeros(4)])  # no load, no diagnostics: not audited
    events = [
        (s.attributes[semconv.ATTR_STEP], dict(e.attributes))
        for s in otel.spans()
        if s.name == semconv.SPAN_STEP
        for e in s.events
        if e.name == semconv.EVENT_DTYPE_CONTRACT
    ]
    got = [
        (step, e[semconv.ATTR_OPTIMIZER_STATE], e[semconv.ATTR_DTYPE_EXPECTED], e[semconv.ATTR_DTYPE_ACTUAL])
        for step, e in events
    ]
    assert got == [(1, "momentum_buffer", "float32", "bfloat16"), (4, "momentum_buffer", "float32", "float16")], got
    points = otel.points()[semconv.METRIC_DTYPE_CONTRACT]
    assert sorted((p.attributes[semconv.ATTR_DTYPE_ACTUAL], p.value) for p in points) == [
        ("bfloat16", 1),
        ("float16", 1),
    ]


def test_observer_puts_findings_on_the_precision_span_and_units_on_metrics_only_when_asked(
    otel, make_observer, monkeypatch
):
    monkeypatch.setenv("FSDP_PATCH_PRECISION_EVERY", "1")
    main = torch.linspace(1, 2, 64)
    group = Group(main.clone(), main.to(BF16), torch.ones(64, dtype=BF16))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # held: the observer's is weak
    observer = make_observer(optimizer)
    run_fake_step(observer, [group], [main + 1e-5])  # every update below bf16's resolution near 1-2
    (span,) = [s for s in otel.spans() if s.name == semconv.SPAN_PRECISION]
    events = [
        (e.attributes[semconv.ATTR_DIAGNOSTIC], e.attributes[semconv.ATTR_PARAM])
        for e in span.events
        if e.name == semconv.EVENT_OFFENDER
    ]
    assert (semconv.METRIC_LOST_RATIO, "group0") in events and (
        semconv.DIAGNOSTIC_UPDATE_RESOLUTION,
        "group0",
    ) in events, events
    assert span.attributes[semconv.ATTR_STUCK_PARAMS] == 0  # one step in a row: below the window
    labels = {k for points in otel.points().values() for p in points for k in p.attributes}
    assert semconv.ATTR_UNIT not in labels and semconv.ATTR_PARAM not in labels, labels

    monkeypatch.setenv(semconv.SETTING_PRECISION_DETAIL, "unit")
    monkeypatch.setenv(semconv.SETTING_PRECISION_TOP_K, "0")
    otel.span_exporter.clear()
    observer = make_observer(optimizer)
    run_fake_step(observer, [Group(main.clone(), main.to(BF16), torch.ones(64, dtype=BF16))], [main + 1e-5])
    (span,) = [s for s in otel.spans() if s.name == semconv.SPAN_PRECISION]
    assert not span.events, "TOP_K=0: no per-parameter events"
    lost = [p for p in otel.points()[semconv.METRIC_LOST_RATIO] if semconv.ATTR_UNIT in p.attributes]
    assert [(p.attributes[semconv.ATTR_UNIT], p.value) for p in lost] == [("", 1.0)], lost


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        (semconv.SETTING_PRECISION_TOP_K, "-1"),
        (semconv.SETTING_PRECISION_TOP_K, "three"),
        (semconv.SETTING_PRECISION_WINDOW, "0"),
        (semconv.SETTING_PRECISION_DETAIL, "param"),
    ],
)
def test_bad_attribution_settings_name_the_variable(variable: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"{variable}={value!r} is not valid; accepted values: "):
        env.validate_all({variable: value})


def test_attribution_settings_defaults() -> None:
    assert (env.precision_top_k({}), env.precision_window({}), env.precision_detail({})) == (3, 3, "off")
    assert (
        env.precision_top_k({semconv.SETTING_PRECISION_TOP_K: "0"}),
        env.precision_detail({semconv.SETTING_PRECISION_DETAIL: "UNIT"}),
    ) == (0, "unit")


def test_unstepped_weights_in_bfloat16_are_named_as_having_no_fp32_master() -> None:
    """Pure bfloat16 training (vllm-project/speculators#765): main weights are the bfloat16 weights,
    and updates below their resolution round away; the cause is the missing fp32 master."""
    table = [ParamSlot("norm.weight", "", None, 0, 0, 0, 10, None, torch.bfloat16), slot("fc.weight")]
    rows = [row(grad_amax=1.0), row(changed=10, lost=1, grad_amax=1.0, main_sq=1.0)]
    contexts = [ParamContext(lr=1e-3)] * 2
    tracker = attribution.Attribution(top_k=3, window=2)
    tracker.analyze(1, table, rows, contexts, no_ranks)
    findings = tracker.analyze(2, table, rows, contexts, no_ranks)
    got = [(o.slot, o.cause) for o in findings.offenders if o.diagnostic == semconv.DIAGNOSTIC_UNSTEPPED]
    want = [(0, semconv.UNSTEPPED_LOW_PRECISION_MASTER)]
    assert got == want, f"want {want}, got {got}"


def test_grad_underflow_counts_zeros_only_beside_grads_below_the_normal_range() -> None:
    """fp16 grads without loss scaling (engichang1467/Open-Rig3R#35): a fully flushed parameter is
    all zeros, a partly flushed one has grads below float16's normal range; an embedding's unused
    rows are zeros too, and alone (no grad below the normal range anywhere) they are no underflow."""
    table = [slot("fc1.weight"), slot("fc2.weight"), slot("embed.weight")]
    underflowing = [row(grad_zero=10), row(grad_zero=2, grad_tiny=8, grad_amax=1e-5), row(grad_zero=9, grad_amax=0.5)]
    findings = attribution.Attribution(top_k=3, window=3).analyze(
        1, table, underflowing, [ParamContext()] * 3, no_ranks, underflow_measured=True
    )
    got = (findings.grad_underflow, offenders(findings, semconv.DIAGNOSTIC_GRAD_UNDERFLOW))
    want = (29 / 30, [(0, 1.0), (1, 1.0), (2, 0.9)])
    assert got == want, f"want {want}, got {got}"
    sparse = [row(grad_amax=0.5), row(grad_amax=0.5), row(grad_zero=9, grad_amax=0.5)]
    findings = attribution.Attribution(top_k=3, window=3).analyze(
        1, table, sparse, [ParamContext()] * 3, no_ranks, underflow_measured=True
    )
    got = (findings.grad_underflow, offenders(findings, semconv.DIAGNOSTIC_GRAD_UNDERFLOW))
    assert got == (0.0, []), f"an embedding's zero rows alone were named underflow: {got}"
    findings = attribution.Attribution(top_k=3, window=3).analyze(
        1, table, underflowing, [ParamContext()] * 3, no_ranks
    )
    assert findings.grad_underflow is None, "not measured (a GradScaler, or no float16): no value"
