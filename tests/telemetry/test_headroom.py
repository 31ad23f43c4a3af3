"""The headroom forecast from the unit outputs the per-iteration checks take on diagnosed steps."""

from __future__ import annotations

import math

from fsdp_patch.telemetry import semconv
from fsdp_patch.telemetry.diagnostics.headroom import HeadroomTrend
from fsdp_patch.telemetry.diagnostics.probes import Checked, Probe


def _checks(unit: str, magnitude: float, dtype: str = "float16") -> list[Checked]:
    output = Probe(semconv.ORIGIN_FORWARD, unit, dtype)
    model_input = Probe(semconv.ORIGIN_FORWARD, "", dtype, when="input")  # the batch: never a unit output
    grad = Probe(semconv.ORIGIN_BACKWARD, unit, dtype)
    return [Checked(output, -magnitude, magnitude / 2), Checked(model_input, -1e4, 1e4), Checked(grad, -1e4, 1e4)]


def test_an_output_doubling_every_step_is_forecast_to_overflow_float16_once() -> None:
    """Named once it is past 256 (halfway to 65504 on a logarithmic scale), at the doubling's rate."""
    trend = HeadroomTrend()
    forecasts = []
    for step in range(1, 11):
        trend.feed(step, _checks("blocks.1", 4.0 * 2.0**step))
        forecasts.append([(f.unit, f.step, f.steps_left) for f in trend.forecasts()])
    # 4 * 2**6 = 256 at step 6: 65504 / 256 = 2**8 (less a little), 8 steps ahead; named once.
    want_left = math.ceil(math.log2(65504 / 256))
    want = [[]] * 5 + [[("blocks.1", 6, want_left)]] + [[]] * 4
    assert forecasts == want, f"forecasts per step: {forecasts}"


def test_logits_sharpening_early_in_training_are_not_forecast() -> None:
    """A healthy fp16 model's root output grows steadily from 1.8 to 5.8 over its first 100 steps."""
    trend = HeadroomTrend()
    for step, magnitude in zip((3, 5, 10, 20, 50, 100), (1.84, 2.0, 2.4, 3.1, 4.5, 5.85), strict=True):
        trend.feed(step, _checks("", magnitude))
    assert trend.forecasts() == [], [(f.unit, f.steps_left) for f in trend.forecasts()]


def test_a_steady_or_noisy_output_is_not_forecast() -> None:
    trend = HeadroomTrend()
    for step, magnitude in zip((1, 2, 3, 5, 10, 20), (4.0, 9.0, 3.0, 8.0, 4.5, 7.0), strict=True):
        trend.feed(step, _checks("blocks.0", magnitude))
    assert trend.forecasts() == [], [f.unit for f in trend.forecasts()]


def test_growth_that_would_take_far_longer_than_it_was_watched_is_not_forecast() -> None:
    """bfloat16 holds up to 3.4e38: a doubling per step reaches it in over 100 steps, past 10 times
    the 9 steps the fit spans."""
    trend = HeadroomTrend()
    for step in (1, 2, 3, 5, 10):
        trend.feed(step, _checks("blocks.1", 4.0 * 2.0**step, "bfloat16"))
    assert trend.forecasts() == [], [(f.unit, f.steps_left) for f in trend.forecasts()]
