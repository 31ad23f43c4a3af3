"""How fast each unit's output approaches its dtype's largest value, and when it gets there.

The per-iteration checks (:mod:`.origin`) take each unit's output's least and greatest element on
every iteration. On diagnosed steps :class:`HeadroomTrend` keeps the largest finite magnitude of
each unit's output, per dtype, and fits a straight line to its logarithm over the last
:data:`POINTS` diagnosed steps: an output growing by a steady factor per step (a residual stream
in float16 over training, an unstable layer) reaches the dtype's largest finite value in
``(log(max) - log(now)) / slope`` steps. A forecast is made when the fit is good (the growth is
steady, not noise), the output is past halfway to the limit on a logarithmic scale (past 256 in
float16: a model's logits sharpening early in training grow steadily too, from 2 to 6, and that is
no overflow on its way), and the overflow is near: within :data:`HORIZON` times the steps the fit
spans. No device work here: the values are the checks' own, already on the host.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .. import semconv
from .probes import Checked

__all__ = ["HORIZON", "POINTS", "HeadroomForecast", "HeadroomTrend"]

POINTS = 6
"""Diagnosed steps a fit spans (at least 4 are needed)."""
HORIZON = 10.0
"""A forecast is made when the overflow is at most this many times the fitted span ahead."""
GOOD_FIT = 0.9
"""Least share of the variance of log(magnitude) the line explains (R²)."""

_LIMITS = {"float16": float(torch.finfo(torch.float16).max), "bfloat16": float(torch.finfo(torch.bfloat16).max)}


@dataclass(frozen=True)
class HeadroomForecast:
    """One unit's output on its way to its dtype's largest value.

    Attributes:
        unit: The unit, as the model names it (``""``: the root).
        dtype: The output's dtype.
        limit: The dtype's largest finite value.
        first_step, first_amax: The fit's first point.
        step, amax: Its last point (now).
        steps_left: Steps until the output's largest magnitude reaches ``limit`` at this rate.
    """

    unit: str
    dtype: str
    limit: float
    first_step: int
    first_amax: float
    step: int
    amax: float
    steps_left: int


class HeadroomTrend:
    """The units' output magnitudes over diagnosed steps, and their forecasts (see the module)."""

    def __init__(self) -> None:
        self._history: dict[tuple[str, str], deque[tuple[int, float]]] = {}
        self._named: set[tuple[str, str]] = set()

    def feed(self, step: int, checks: Iterable[Checked]) -> None:
        """One diagnosed step's checks (its unit outputs are read; everything else is left)."""
        largest: dict[tuple[str, str], float] = {}
        for checked in checks:
            probe = checked.probe
            if probe.stage != semconv.ORIGIN_FORWARD or probe.when or probe.dtype not in _LIMITS:
                continue
            if not checked.finite:
                continue
            key = (probe.where, probe.dtype)
            largest[key] = max(largest.get(key, 0.0), checked.magnitude)
        for key, amax in largest.items():
            if amax > 0:
                self._history.setdefault(key, deque(maxlen=POINTS)).append((step, math.log(amax)))

    def forecasts(self) -> list[HeadroomForecast]:
        """The units whose output reaches its dtype's largest value soon at the fitted rate, each
        once per run (the first time it is forecast), nearest first."""
        out = []
        for key, points in self._history.items():
            if key in self._named:
                continue
            forecast = _forecast(key, list(points))
            if forecast is not None:
                self._named.add(key)
                out.append(forecast)
        return sorted(out, key=lambda f: f.steps_left)


def _forecast(key: tuple[str, str], points: list[tuple[int, float]]) -> HeadroomForecast | None:
    if len(points) < 4:
        return None
    steps = [float(s) for s, _ in points]
    logs = [v for _, v in points]
    mean_s, mean_v = sum(steps) / len(steps), sum(logs) / len(logs)
    var_s = sum((s - mean_s) ** 2 for s in steps)
    var_v = sum((v - mean_v) ** 2 for v in logs)
    if var_s <= 0 or var_v <= 0:
        return None
    slope = sum((s - mean_s) * (v - mean_v) for s, v in zip(steps, logs, strict=True)) / var_s
    fit = slope * slope * var_s / var_v
    if slope <= 0 or fit < GOOD_FIT:
        return None
    unit, dtype = key
    limit = _LIMITS[dtype]
    step, last = points[-1]
    if last < math.log(limit) / 2:
        return None
    left = (math.log(limit) - last) / slope
    span = points[-1][0] - points[0][0]
    if left > HORIZON * span:
        return None
    first_step, first = points[0]
    return HeadroomForecast(
        unit, dtype, limit, first_step, math.exp(first), step, math.exp(last), max(0, math.ceil(left))
    )
