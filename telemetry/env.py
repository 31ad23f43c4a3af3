"""The ``FSDP_PATCH_*`` environment variables, parsed strictly.

This module imports neither torch nor OpenTelemetry: ``fsdp_patch`` calls
:func:`telemetry_enabled` on every adapted optimizer, and when telemetry is off
nothing else of this package may be imported.

Every parser reads the environment when called (no caching), raises
:class:`ValueError` naming the variable, the bad value and the accepted values,
and treats an unset or empty variable as its default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

TELEMETRY = "FSDP_PATCH_TELEMETRY"
PRECISION_EVERY = "FSDP_PATCH_PRECISION_EVERY"
TRACE_RANKS = "FSDP_PATCH_TRACE_RANKS"
TRACE_DIR = "FSDP_PATCH_TRACE_DIR"
SUMMARY = "FSDP_PATCH_SUMMARY"
FLUSH_TIMEOUT = "FSDP_PATCH_FLUSH_TIMEOUT"
COMPUTE_DTYPE = "FSDP_PATCH_COMPUTE_DTYPE"
PROMETHEUS_FINAL_SCRAPES = "FSDP_PATCH_PROMETHEUS_FINAL_SCRAPES"
PROMETHEUS_FINAL_SCRAPE_TIMEOUT = "FSDP_PATCH_PROMETHEUS_FINAL_SCRAPE_TIMEOUT"

# Diagnostics clone the local weight shards (6 bytes per element for fp32 main and bf16
# compute weights) and add a few reading passes plus one tiny collective. Every 100 steps
# keeps the amortised time cost well under 1% while still giving a curve over a run.
DEFAULT_PRECISION_EVERY = 100
DEFAULT_TRACE_DIR = "fsdp_patch_traces"
DEFAULT_FLUSH_TIMEOUT_S = 10.0
# Twice Prometheus's default scrape interval (15 s): one scrape of the final values at the
# default, while a job whose endpoint nobody scrapes does not wait at all.
DEFAULT_PROMETHEUS_FINAL_SCRAPE_TIMEOUT_S = 30.0

SUMMARY_MODES = ("rank0", "all", "none")

# Accepted spellings of FSDP_PATCH_COMPUTE_DTYPE and the torch dtype attribute each names.
COMPUTE_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
}

_TRUE = ("1", "true")
_FALSE = ("", "0", "false")


def _raw(name: str, environ: Mapping[str, str] | None) -> str:
    env = os.environ if environ is None else environ
    return env.get(name, "").strip()


def _invalid(name: str, value: str, accepted: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not valid; accepted values: {accepted}")


def telemetry_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``FSDP_PATCH_TELEMETRY`` asks for spans and metrics.

    Args:
        environ: Mapping to read instead of ``os.environ`` (tests).

    Returns:
        ``False`` when the variable is unset, empty, ``0`` or ``false``; ``True`` for
        ``1`` or ``true`` (case-insensitive).

    Raises:
        ValueError: Any other value; a typo must not silently turn telemetry off.
    """
    value = _raw(TELEMETRY, environ)
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise _invalid(TELEMETRY, value, "unset, '', '0', 'false' (off); '1', 'true' (on), case-insensitive")


def precision_every(environ: Mapping[str, str] | None = None) -> int:
    """Step interval of the precision diagnostics (``FSDP_PATCH_PRECISION_EVERY``).

    Returns:
        ``0`` (off) or a positive interval; :data:`DEFAULT_PRECISION_EVERY` when unset.

    Raises:
        ValueError: Not a non-negative integer.
    """
    value = _raw(PRECISION_EVERY, environ)
    if not value:
        return DEFAULT_PRECISION_EVERY
    try:
        every = int(value)
    except ValueError:
        every = -1
    if every < 0:
        raise _invalid(PRECISION_EVERY, value, "a non-negative integer (0 turns diagnostics off)")
    return every


def trace_ranks(environ: Mapping[str, str] | None = None) -> frozenset[int] | None:
    """Ranks that emit spans (``FSDP_PATCH_TRACE_RANKS``).

    Accepts ``all`` (the default), ``none``, or a comma-separated list of ranks and
    inclusive ranges, for example ``0,3`` or ``0-3,8``.

    Returns:
        ``None`` for every rank, else the selected ranks (possibly empty).

    Raises:
        ValueError: Anything else.
    """
    value = _raw(TRACE_RANKS, environ)
    if value.lower() in ("", "all"):
        return None
    if value.lower() == "none":
        return frozenset()
    ranks: set[int] = set()
    try:
        for item in value.split(","):
            first, sep, last = item.strip().partition("-")
            lo = int(first)
            hi = int(last) if sep else lo
            if lo < 0 or hi < lo:
                raise ValueError(item)
            ranks.update(range(lo, hi + 1))
    except ValueError:
        raise _invalid(TRACE_RANKS, value, "'all', 'none', or ranks and ranges such as '0,3' or '0-3,8'") from None
    return frozenset(ranks)


def trace_dir(environ: Mapping[str, str] | None = None) -> str:
    """Directory of the embedded trace files (``FSDP_PATCH_TRACE_DIR``), relative to the cwd by default."""
    return _raw(TRACE_DIR, environ) or DEFAULT_TRACE_DIR


def summary_mode(environ: Mapping[str, str] | None = None) -> str:
    """Which ranks print the exit summary (``FSDP_PATCH_SUMMARY``): ``rank0`` (default), ``all`` or ``none``.

    Raises:
        ValueError: Any other value.
    """
    value = _raw(SUMMARY, environ).lower() or "rank0"
    if value not in SUMMARY_MODES:
        raise _invalid(SUMMARY, value, ", ".join(repr(m) for m in SUMMARY_MODES))
    return value


def _seconds(name: str, environ: Mapping[str, str] | None, default: float) -> float:
    value = _raw(name, environ)
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise _invalid(name, value, "a positive, finite number of seconds")
    return seconds


def flush_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """Upper bound in seconds for one flush or shutdown of the exporters (``FSDP_PATCH_FLUSH_TIMEOUT``).

    Raises:
        ValueError: Not a positive number.
    """
    return _seconds(FLUSH_TIMEOUT, environ, DEFAULT_FLUSH_TIMEOUT_S)


def prometheus_final_scrapes(environ: Mapping[str, str] | None = None) -> int | None:
    """Scrapes of its final values a rank's Prometheus endpoint waits for at exit
    (``FSDP_PATCH_PROMETHEUS_FINAL_SCRAPES``).

    Returns:
        ``None`` when unset: one scrape where the endpoint was scraped during the run, none
        where nobody scrapes it. Else the number, waited for whether or not a scrape was seen;
        ``0`` never waits.

    Raises:
        ValueError: Not a non-negative integer.
    """
    if not _raw(PROMETHEUS_FINAL_SCRAPES, environ):
        return None
    return _int_at_least(PROMETHEUS_FINAL_SCRAPES, environ, 0, 0, "a non-negative integer (0: do not wait)")


def prometheus_final_scrape_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """Most seconds a rank waits at exit for Prometheus to scrape its final values
    (``FSDP_PATCH_PROMETHEUS_FINAL_SCRAPE_TIMEOUT``).

    Raises:
        ValueError: Not a positive number.
    """
    return _seconds(PROMETHEUS_FINAL_SCRAPE_TIMEOUT, environ, DEFAULT_PROMETHEUS_FINAL_SCRAPE_TIMEOUT_S)


def compute_dtype(environ: Mapping[str, str] | None = None) -> str | None:
    """Compute dtype of torch FSDP2 groups whose ``MixedPrecisionPolicy`` sets no ``param_dtype``
    (``FSDP_PATCH_COMPUTE_DTYPE``), for the precision diagnostics; for example ``bfloat16`` for a
    model that runs under autocast.

    Returns:
        The torch dtype's name (``"bfloat16"``, ``"float16"``, ``"float32"``), or ``None`` when unset.

    Raises:
        ValueError: Any other value.
    """
    value = _raw(COMPUTE_DTYPE, environ).lower()
    if not value:
        return None
    if value not in COMPUTE_DTYPES:
        raise _invalid(COMPUTE_DTYPE, value, ", ".join(repr(v) for v in COMPUTE_DTYPES))
    return COMPUTE_DTYPES[value]


# -- attribution settings (names in semconv) ---------------------------------------------

DEFAULT_PRECISION_TOP_K = 3
DEFAULT_PRECISION_WINDOW = 3


def _int_at_least(name: str, environ: Mapping[str, str] | None, default: int, least: int, accepted: str) -> int:
    value = _raw(name, environ)
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        number = least - 1
    if number < least:
        raise _invalid(name, value, accepted)
    return number


def precision_top_k(environ: Mapping[str, str] | None = None) -> int:
    """Offenders per diagnostic on the precision span (``FSDP_PATCH_PRECISION_TOP_K``).

    Returns:
        :data:`DEFAULT_PRECISION_TOP_K` when unset; ``0`` turns the per-parameter detail off.

    Raises:
        ValueError: Not a non-negative integer.
    """
    from . import semconv  # here: with telemetry off, deciding so imports this module alone

    return _int_at_least(
        semconv.SETTING_PRECISION_TOP_K,
        environ,
        DEFAULT_PRECISION_TOP_K,
        0,
        "a non-negative integer (0 turns the per-parameter detail off)",
    )


def precision_window(environ: Mapping[str, str] | None = None) -> int:
    """Diagnosed steps in a row before a weight is named stuck or unstepped (``FSDP_PATCH_PRECISION_WINDOW``).

    Raises:
        ValueError: Not a positive integer.
    """
    from . import semconv

    return _int_at_least(semconv.SETTING_PRECISION_WINDOW, environ, DEFAULT_PRECISION_WINDOW, 1, "a positive integer")


DEFAULT_PRECISION_ESCALATION = 3
# An audited iteration costs a few plain ones (each low-precision operation runs again in
# float32, with its statistics; about 8 on case 5, benchmarks.op_audit_cost): one in 1000 keeps
# that under 1% of a run.
DEFAULT_PRECISION_AUDIT_EVERY = 1000


def precision_escalation(environ: Mapping[str, str] | None = None) -> int:
    """Iterations of module-level checks and diagnostics every step after a NaN/Inf is seen
    (``FSDP_PATCH_PRECISION_ESCALATION``).

    Returns:
        :data:`DEFAULT_PRECISION_ESCALATION` when unset; ``0`` turns escalation off.

    Raises:
        ValueError: Not a non-negative integer.
    """
    from . import semconv

    return _int_at_least(
        semconv.SETTING_PRECISION_ESCALATION,
        environ,
        DEFAULT_PRECISION_ESCALATION,
        0,
        "a non-negative integer (0 turns escalation off)",
    )


def precision_origin(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the per-iteration checks run (``FSDP_PATCH_PRECISION_ORIGIN``: ``on``, the default, or ``off``).

    Raises:
        ValueError: Any other value.
    """
    from . import semconv

    value = _raw(semconv.SETTING_PRECISION_ORIGIN, environ).lower() or "on"
    if value not in ("on", "off"):
        raise _invalid(semconv.SETTING_PRECISION_ORIGIN, value, "'on', 'off'")
    return value == "on"


def precision_detail(environ: Mapping[str, str] | None = None) -> str:
    """``FSDP_PATCH_PRECISION_DETAIL``: ``off`` (default) or ``unit`` (precision metrics labelled by unit).

    Raises:
        ValueError: Any other value.
    """
    from . import semconv

    value = _raw(semconv.SETTING_PRECISION_DETAIL, environ).lower() or semconv.DETAIL_OFF
    if value not in semconv.DETAILS:
        raise _invalid(semconv.SETTING_PRECISION_DETAIL, value, ", ".join(repr(d) for d in semconv.DETAILS))
    return value


def precision_audit_every(environ: Mapping[str, str] | None = None) -> int:
    """Iterations between operation audits (``FSDP_PATCH_PRECISION_AUDIT_EVERY``).

    Returns:
        :data:`DEFAULT_PRECISION_AUDIT_EVERY` when unset; ``0`` turns the audit off.

    Raises:
        ValueError: Not a non-negative integer.
    """
    from . import semconv

    return _int_at_least(
        semconv.SETTING_PRECISION_AUDIT_EVERY,
        environ,
        DEFAULT_PRECISION_AUDIT_EVERY,
        0,
        "a non-negative integer (0 turns the operation audit off)",
    )


DEFAULT_PRECISION_SHADOW_EVERY = 1000
# A shadowed iteration runs each leaf module's forward twice more in float32 and gathers each
# unit's main weights once (benchmarks.op_audit_cost measures it): one in 1000 keeps that small.


def precision_shadow_every(environ: Mapping[str, str] | None = None) -> int:
    """Iterations between float32 shadows of the forward (``FSDP_PATCH_PRECISION_SHADOW_EVERY``).

    Returns:
        :data:`DEFAULT_PRECISION_SHADOW_EVERY` when unset; ``0`` turns the shadow off.

    Raises:
        ValueError: Not a non-negative integer.
    """
    from . import semconv

    return _int_at_least(
        semconv.SETTING_PRECISION_SHADOW_EVERY,
        environ,
        DEFAULT_PRECISION_SHADOW_EVERY,
        0,
        "a non-negative integer (0 turns the float32 shadow off)",
    )


def sdk_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """``OTEL_SDK_DISABLED``, read exactly as the OpenTelemetry SDK reads it (only ``true`` disables)."""
    return _raw("OTEL_SDK_DISABLED", environ).lower() == "true"


def validate_all(environ: Mapping[str, str] | None = None) -> None:
    """Parse every ``FSDP_PATCH_*`` variable so a typo fails when the optimizer is adapted, not hours later.

    Raises:
        ValueError: The first malformed variable.
    """
    telemetry_enabled(environ)
    precision_every(environ)
    trace_ranks(environ)
    summary_mode(environ)
    flush_timeout_s(environ)
    prometheus_final_scrapes(environ)
    prometheus_final_scrape_timeout_s(environ)
    compute_dtype(environ)
    precision_top_k(environ)
    precision_window(environ)
    precision_escalation(environ)
    precision_origin(environ)
    precision_detail(environ)
    precision_audit_every(environ)
    precision_shadow_every(environ)
