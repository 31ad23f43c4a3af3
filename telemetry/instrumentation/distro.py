"""``opentelemetry-instrument``'s distro for fsdp_patch: the embedded default's exporters where none is set.

Registered as the entry point ``fsdp_patch`` of the group ``opentelemetry_distro``
(``pyproject.toml``). ``opentelemetry-instrument`` configures the distro before the SDK
configurator reads the ``OTEL_*`` variables, so what it sets here is what the configurator builds
the global providers from: with nothing set, ``trace_file`` for traces and ``summary`` for metrics
(the defaults :mod:`~fsdp_patch.telemetry.export.selection` gives ``FSDP_PATCH_TELEMETRY=1``), no
log exporter (fsdp_patch emits no logs through OpenTelemetry), and ``otlp`` meaning OTLP over
http/protobuf, as it does under the embedded default. Variables the user set are kept. It also
adds the resource detector ``fsdp_patch`` (the rank identity, :class:`~fsdp_patch.telemetry.export.resource.RankResourceDetector`)
to ``OTEL_EXPERIMENTAL_RESOURCE_DETECTORS``, after the detectors listed there.

Where no configurator is installed (``opentelemetry-distro`` absent) no global provider is set, and
the instrumentor builds the embedded default from the same variables: the same exporters either way.

With ``opentelemetry-distro`` installed too, two distros are registered and
``opentelemetry-instrument`` takes the first it finds unless ``OTEL_PYTHON_DISTRO`` names one:
``OTEL_PYTHON_DISTRO=fsdp_patch`` selects this one, ``distro`` OpenTelemetry's (OTLP to a collector).

Alternatives considered:

- An ``opentelemetry_configurator`` entry point of our own: the SDK's configurator class
  (``opentelemetry.sdk._configuration._OTelSDKConfigurator``) is private, so a configurator built on
  it brings back a private SDK name; one written from scratch repeats what the SDK's does. The
  defaults are all the embedded default adds under ``opentelemetry-instrument``, and setting
  defaults is what the distro seam is for (``opentelemetry-distro`` sets its OTLP defaults the same way).
- Installing the embedded default's providers from the distro: they would become the global
  providers, which the embedded default never installs (an application may install its own).
"""

from __future__ import annotations

import os
from typing import Any

from opentelemetry.instrumentation.distro import BaseDistro  # type: ignore[attr-defined]  # the module opts out of mypy (a file-level ignore)

from ..export import selection

LOGS_EXPORTER = "OTEL_LOGS_EXPORTER"
RESOURCE_DETECTORS = "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS"
RANK_DETECTOR = "fsdp_patch"  # the entry point of RankResourceDetector (pyproject.toml)
OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"


def default_settings() -> dict[str, str]:
    """The ``OTEL_*`` variables the distro sets where they are unset or empty, with their values."""
    return {
        **{selection.VARIABLES[signal]: selection.DEFAULTS[signal] for signal in selection.VARIABLES},
        LOGS_EXPORTER: "none",
        OTLP_PROTOCOL: selection.DEFAULT_OTLP_PROTOCOL,
    }


class FSDPPatchDistro(BaseDistro):
    """Sets the embedded default's exporters as the ``OTEL_*`` defaults before the SDK configurator runs."""

    def _configure(self, **kwargs: Any) -> None:
        for variable, value in default_settings().items():
            # Empty counts as unset, as selection.listed_names reads it.
            if not os.environ.get(variable, "").strip():
                os.environ[variable] = value
        detectors = [name.strip() for name in os.environ.get(RESOURCE_DETECTORS, "").split(",") if name.strip()]
        if RANK_DETECTOR not in detectors:
            os.environ[RESOURCE_DETECTORS] = ",".join([*detectors, RANK_DETECTOR])
