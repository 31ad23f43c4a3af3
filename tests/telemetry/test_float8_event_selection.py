"""Which float8 casts become events: all of them up to ``ALL_ROWS_UP_TO`` an iteration; past it,
the casts that keep the least per role, those a check names, the first and last modules, and every
cast shown before (its scale's trend goes on)."""

from __future__ import annotations

import torch
from fsdp_patch.telemetry import semconv
from fsdp_patch.telemetry.diagnostics.float8_casts import VALUES
from fsdp_patch.telemetry.instrumentation.float8_watch import ALL_ROWS_UP_TO, CastRow, Float8Watch

HEALTHY = {key: 0.0 for key in VALUES} | {"amax": 1.0, "scale": 448.0, "scale_max": 448.0, "sqnr": 31.0}


def _rows(modules: int, worse: dict[str, float] | None = None) -> list[CastRow]:
    """``modules`` float8 modules, each with its three casts healthy but for ``worse`` (module -> share
    of its input's elements left subnormal)."""
    rows = []
    for index in range(modules):
        name = f"layers.{index}"
        position = (
            semconv.FLOAT8_POSITION_FIRST
            if index == 0
            else semconv.FLOAT8_POSITION_LAST
            if index == modules - 1
            else semconv.FLOAT8_POSITION_MIDDLE
        )
        for role in semconv.FLOAT8_ROLES:
            values = dict(HEALTHY)
            if role == semconv.FLOAT8_ROLE_INPUT and worse and name in worse:
                values["subnormal"] = worse[name]
            rows.append(CastRow(name, role, "float8_e4m3fn", "tensorwise", False, values, 1, position))
    return rows


def _watch() -> Float8Watch:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return Float8Watch(optimizer, on=True)


def _shown(watch: Float8Watch, rows: list[CastRow]) -> set[tuple[str, str]]:
    return {(row.module, row.role) for row in watch._shown(rows)}


def test_every_cast_is_an_event_up_to_the_limit() -> None:
    rows = _rows(ALL_ROWS_UP_TO // 3)
    got = len(_shown(_watch(), rows))
    assert got == len(rows) == ALL_ROWS_UP_TO, f"want all {len(rows)} casts shown, got {got}"


def test_past_the_limit_the_worst_the_ends_and_those_shown_before_are_events() -> None:
    """40 modules: per role the top 3 that keep the least (here ties among healthy casts, and
    three inputs left 30-40% subnormal), the first and last modules' every cast; at the next step,
    where the worst inputs are others, those of the step before are still shown."""
    watch = _watch()
    worse = {"layers.7": 0.4, "layers.8": 0.35, "layers.9": 0.3}
    first = _shown(watch, _rows(40, worse))
    inputs = {module for module, role in first if role == semconv.FLOAT8_ROLE_INPUT}
    want_inputs = {"layers.0", "layers.39", *worse}
    assert inputs == want_inputs, f"inputs shown: want {sorted(want_inputs)}, got {sorted(inputs)}"
    ends = {(f"layers.{i}", role) for i in (0, 39) for role in semconv.FLOAT8_ROLES}
    assert ends <= first, f"the first and last modules' casts: missing {sorted(ends - first)}"
    assert len(first) < 40 * 3, f"want a selection past {ALL_ROWS_UP_TO} casts, got all {len(first)}"
    second = _shown(watch, _rows(40, {"layers.20": 0.45, "layers.21": 0.4, "layers.22": 0.35}))
    kept = {key for key in first if key not in second}
    assert not kept, f"casts shown at the step before and dropped now (their trend would break): {sorted(kept)}"
    assert ("layers.20", semconv.FLOAT8_ROLE_INPUT) in second, f"the new worst input is not shown: {sorted(second)}"
