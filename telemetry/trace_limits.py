"""How much disk the embedded trace files may take per rank (``FSDP_PATCH_TRACE_MAX_BYTES``).

No torch and no OpenTelemetry here (like :mod:`fsdp_patch.telemetry.env`, whose parsers this
one follows: it reads the environment when called and raises ``ValueError`` naming the
variable, the value and what is accepted).

The cap covers every file of one rank: the Chrome trace segments take at most
:data:`CHROME_SHARE` of it (two segments, the older one deleted when the newer one fills, so
the newest steps are kept), and the Jaeger file written at exit gets what is left.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

TRACE_MAX_BYTES = "FSDP_PATCH_TRACE_MAX_BYTES"

# 1.5 KB of Chrome trace per step and rank (measured over 6,000 steps): a quarter of 128 MiB
# keeps the newest ~20,000 steps, and the Jaeger conversion at exit (about 2.6 times the
# Chrome bytes) fits in the other three quarters.
DEFAULT_TRACE_MAX_BYTES = 128 << 20
# The smallest cap: a segment must hold its header events and at least a few spans.
MIN_TRACE_MAX_BYTES = 64 << 10
# Chrome segments kept per rank: the one being written and the one before it.
CHROME_SEGMENTS = 2
# Fraction of the cap for all Chrome segments together; the rest is for the Jaeger file.
CHROME_SHARE = 0.25
# Larger Chrome traces (possible only without a cap) are not converted to Jaeger JSON at exit,
# which would hold up interpreter exit; `fsdp-patch trace jaeger` converts them on demand.
JAEGER_AT_EXIT_MAX_BYTES = 64 << 20

_SIZE = re.compile(r"^(\d+)\s*([kmg]i?b?|b)?$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def trace_max_bytes(environ: Mapping[str, str] | None = None) -> int:
    """The per-rank cap in bytes; ``0`` means no cap.

    Accepts a whole number of bytes, optionally with a binary unit: ``65536``, ``64K``,
    ``128M``, ``1G`` (also ``KiB``, ``MiB``, ``GiB``); unset or empty gives
    :data:`DEFAULT_TRACE_MAX_BYTES`.

    Raises:
        ValueError: Anything else, or a cap between 1 byte and :data:`MIN_TRACE_MAX_BYTES`.
    """
    raw = (os.environ if environ is None else environ).get(TRACE_MAX_BYTES, "").strip()
    if not raw:
        return DEFAULT_TRACE_MAX_BYTES
    match = _SIZE.match(raw)
    accepted = f"0 (no cap) or a size of at least {MIN_TRACE_MAX_BYTES >> 10}K, such as 65536, 64K, 128M, 1G"
    if not match:
        raise ValueError(f"{TRACE_MAX_BYTES}={raw!r} is not valid; accepted values: {accepted}")
    value = int(match[1]) * _UNITS[(match[2] or "")[:1].lower()]
    if 0 < value < MIN_TRACE_MAX_BYTES:
        raise ValueError(f"{TRACE_MAX_BYTES}={raw!r} is too small; accepted values: {accepted}")
    return value


def chrome_segment_bytes(max_bytes: int) -> int:
    """Largest size of one Chrome segment under the cap ``max_bytes`` (0: unbounded)."""
    return int(max_bytes * CHROME_SHARE) // CHROME_SEGMENTS if max_bytes else 0


def size_text(nbytes: int) -> str:
    """``nbytes`` for people, in the binary units the variable takes: ``64 KiB``, ``128 MiB``, ``1.5 GiB``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.4g} {unit}"
    return f"{nbytes} bytes"
