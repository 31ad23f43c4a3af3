"""The one table of metric instruments, and the code that creates them from it.

Names, kinds, units and attributes are fixed by docs/conventions.md; dashboards
query them, so change them only together with ``dashboards/``. ``fsdp.rank`` is added
to every data point on top of the attributes listed here, because Prometheus drops
resource attributes and dashboards split by rank; with ``FSDP_PATCH_PRECISION_DETAIL=unit`` the
precision diagnostics' points also carry ``fsdp.unit``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import semconv

if TYPE_CHECKING:
    import torch
    from opentelemetry.metrics import Meter
    from opentelemetry.util.types import AttributeValue

COUNTER = "Counter"
HISTOGRAM = "Histogram"
GAUGE = "Gauge"

# The SDK's default histogram buckets are meant for milliseconds (0, 5, 10, ... 10000); in
# seconds every optimizer step would fall into the first bucket. These span 100 µs to 1 min.
DURATION_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


@dataclass(frozen=True)
class InstrumentSpec:
    """One row of the instrument table.

    Attributes:
        name: OpenTelemetry instrument name.
        kind: :data:`COUNTER`, :data:`HISTOGRAM` or :data:`GAUGE` (synchronous instruments only).
        unit: UCUM unit; it also picks the Prometheus suffix (``By`` -> ``_bytes``, ``s`` -> ``_seconds``).
        description: Shown by backends next to the series.
        attributes: Data-point attribute keys besides ``fsdp.rank``.
        buckets: Explicit histogram bucket boundaries, histograms only.
    """

    name: str
    kind: str
    unit: str
    description: str
    attributes: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


# Names from the one module that spells them; kept here under their short names too.
CAST_SIZE = semconv.METRIC_CAST_SIZE
REFRESH_DURATION = semconv.METRIC_REFRESH_DURATION
STEP_DURATION = semconv.METRIC_STEP_DURATION
DTYPE_MISMATCHES = semconv.METRIC_DTYPE_MISMATCHES
NONFINITE = semconv.METRIC_NONFINITE
REFRESH_OVERFLOW = semconv.METRIC_REFRESH_OVERFLOW
REFRESH_UNDERFLOW = semconv.METRIC_REFRESH_UNDERFLOW
REFRESH_ERROR = semconv.METRIC_REFRESH_ERROR
LOST_RATIO = semconv.METRIC_LOST_RATIO
GRAD_AMAX = semconv.METRIC_GRAD_AMAX
PRECISION_STEPS = semconv.METRIC_PRECISION_STEPS
NONFINITE_STEPS = semconv.METRIC_NONFINITE_STEPS
DTYPE_CONTRACT = semconv.METRIC_DTYPE_CONTRACT
SKIPPED_STEPS = semconv.METRIC_SKIPPED_STEPS
OPTIMIZER_SKIPPED_STEPS = semconv.METRIC_OPTIMIZER_SKIPPED_STEPS

RANK_ATTRIBUTE = semconv.ATTR_RANK

INSTRUMENTS: tuple[InstrumentSpec, ...] = (
    InstrumentSpec(
        CAST_SIZE,
        COUNTER,
        "By",
        "Bytes written by dtype casts around the optimizer step (size of each cast's output).",
        (semconv.ATTR_CAST_KIND, semconv.ATTR_DTYPE_SOURCE, semconv.ATTR_DTYPE_TARGET),
    ),
    InstrumentSpec(
        REFRESH_DURATION,
        HISTOGRAM,
        "s",
        "Time to refresh the compute weights from the main weights (device time on CUDA).",
        buckets=DURATION_BUCKETS_S,
    ),
    InstrumentSpec(
        STEP_DURATION,
        HISTOGRAM,
        "s",
        "Time of one adapted optimizer.step() (device time on CUDA).",
        buckets=DURATION_BUCKETS_S,
    ),
    InstrumentSpec(
        DTYPE_MISMATCHES,
        COUNTER,
        "{parameter}",
        "Parameters, per step, whose grad dtype differs from their data dtype.",
        (semconv.ATTR_DTYPE_PARAM, semconv.ATTR_DTYPE_GRAD, semconv.ATTR_MISMATCH_ACTION),
    ),
    InstrumentSpec(
        NONFINITE,
        COUNTER,
        "{element}",
        "NaN and Inf elements found by the precision diagnostics, summed over ranks.",
        (semconv.ATTR_TENSOR, semconv.ATTR_NONFINITE_KIND),
    ),
    InstrumentSpec(
        REFRESH_OVERFLOW,
        COUNTER,
        "{element}",
        "Elements finite in the main weight and infinite in the refreshed compute weight.",
    ),
    InstrumentSpec(
        REFRESH_UNDERFLOW,
        COUNTER,
        "{element}",
        "Elements non-zero in the main weight and zero in the refreshed compute weight.",
    ),
    InstrumentSpec(
        REFRESH_ERROR,
        GAUGE,
        "1",
        "Relative error of the refresh, ‖compute − main‖₂ / ‖main‖₂, over finite elements of all ranks.",
    ),
    InstrumentSpec(
        LOST_RATIO,
        GAUGE,
        "1",
        "Among elements whose main weight changed this step, the fraction whose compute weight did not.",
    ),
    InstrumentSpec(
        GRAD_AMAX,
        GAUGE,
        "1",
        "Largest absolute main-grad value over all ranks; float32's largest finite value when a grad is NaN or Inf.",
    ),
    InstrumentSpec(
        PRECISION_STEPS,
        COUNTER,
        "{step}",
        "Optimizer steps whose precision diagnostics were recorded (the same count on every rank).",
    ),
    InstrumentSpec(
        NONFINITE_STEPS,
        COUNTER,
        "{step}",
        "Diagnosed steps that found a NaN or Inf element in any tensor of any rank.",
    ),
    # Attribution (docs/conventions.md, "Attribution").
    InstrumentSpec(
        DTYPE_CONTRACT,
        COUNTER,
        "{tensor}",
        "Tensors found in a dtype the mixed-precision contract does not expect, each counted once.",
        (semconv.ATTR_TENSOR, semconv.ATTR_DTYPE_EXPECTED, semconv.ATTR_DTYPE_ACTUAL),
    ),
    InstrumentSpec(
        SKIPPED_STEPS,
        COUNTER,
        "{step}",
        "Diagnosed steps in which no main weight the optimizer steps changed although grads were non-zero and finite.",
    ),
    # Step accounting.
    InstrumentSpec(
        OPTIMIZER_SKIPPED_STEPS,
        COUNTER,
        "{step}",
        "Iterations a GradScaler ended without stepping the optimizer (their grads held NaN or Inf).",
    ),
)


def create_instruments(meter: Meter) -> dict[str, Any]:
    """Create every instrument of :data:`INSTRUMENTS` on ``meter``.

    Args:
        meter: Meter to create the instruments on.

    Returns:
        Instrument objects keyed by instrument name.
    """
    created: dict[str, Any] = {}
    for spec in INSTRUMENTS:
        if spec.kind == COUNTER:
            created[spec.name] = meter.create_counter(spec.name, spec.unit, spec.description)
        elif spec.kind == HISTOGRAM:
            created[spec.name] = meter.create_histogram(
                spec.name, spec.unit, spec.description, explicit_bucket_boundaries_advisory=spec.buckets
            )
        elif spec.kind == GAUGE:
            created[spec.name] = meter.create_gauge(spec.name, spec.unit, spec.description)
        else:  # pragma: no cover - guards edits of the table itself
            raise ValueError(f"unknown instrument kind {spec.kind!r} for {spec.name}")
    return created


def markdown_table() -> str:
    """The instrument table as Markdown, the form ``telemetry/README.md`` embeds."""
    rows = [
        "| name | instrument | unit | attributes (plus `fsdp.rank`) | description |",
        "| --- | --- | --- | --- | --- |",
    ]
    for spec in INSTRUMENTS:
        attributes = ", ".join(f"`{a}`" for a in spec.attributes) or "—"
        rows.append(f"| `{spec.name}` | {spec.kind} | `{spec.unit}` | {attributes} | {spec.description} |")
    return "\n".join(rows)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the form used in metric attributes."""
    return str(dtype).removeprefix("torch.")


class AttributeCache:
    """Attribute sets of data points, built once per key on top of ``base`` (the rank): an
    instrument call with a dict it saw before is cheaper than with a new one, and building the
    dict each step costs more than the lookup."""

    def __init__(self, base: dict[str, AttributeValue]) -> None:
        self._base = base
        self._sets: dict[tuple[Any, ...], dict[str, AttributeValue]] = {}

    def get(self, key: tuple[Any, ...], build: Callable[..., dict[str, AttributeValue]]) -> dict[str, AttributeValue]:
        attrs = self._sets.get(key)
        if attrs is None:
            attrs = self._sets[key] = {**self._base, **build()}
        return attrs


class CounterAdds:
    """Adds to counters, a zero only the first time its series is seen.

    That first add makes the series (exported as 0 from then on, so dashboards see a clean run
    as 0, not as no data); a later zero changes no cumulative series, and each add is an SDK call
    of about 10 us (its attributes cleaned and hashed, under a lock). Under delta temporality an
    interval with only zeros has no point rather than a 0.
    """

    def __init__(self) -> None:
        self._made: set[tuple[Any, ...]] = set()

    def add(self, counter: Any, amount: int, attributes: dict[str, AttributeValue]) -> None:
        if not amount:
            series = (id(counter), *attributes.items())
            if series in self._made:
                return
            self._made.add(series)
        counter.add(amount, attributes)
