"""The resource of the providers the embedded default builds: the ``OTEL_*`` resource plus the rank identity.

Below both the exporters (the trace-file exporter names the resource in its files, also when the
SDK's configurator constructs it without arguments) and the providers (which give it to the
tracer and meter providers), so that neither has to import the other for it.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.resources import SERVICE_NAME, Resource

from .. import semconv
from . import otel_env
from .ranks import RankInfo

DEFAULT_SERVICE_NAME = "fsdp_patch"


def rank_attributes(rank_info: RankInfo) -> dict[str, Any]:
    """The resource attributes of the rank identity (docs/conventions.md): rank, world size, local rank, run id."""
    ours: dict[str, Any] = {
        semconv.RESOURCE_RANK: rank_info.rank,
        semconv.RESOURCE_WORLD_SIZE: rank_info.world_size,
        semconv.RESOURCE_LOCAL_RANK: rank_info.local_rank,
    }
    if rank_info.run_id:
        ours[semconv.RESOURCE_RUN_ID] = rank_info.run_id
    return ours


def build_resource(rank_info: RankInfo) -> Resource:
    """Resource of our providers: the ``OTEL_*`` resource plus the rank identity.

    ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` are honoured; without a service
    name the service is ``fsdp_patch`` instead of the SDK's ``unknown_service``.
    """
    detected = Resource.create()
    ours = rank_attributes(rank_info)
    detected_name = str(detected.attributes.get(SERVICE_NAME, ""))
    if detected_name.startswith("unknown_service") or not detected_name.strip():  # unset, or set blank
        ours[SERVICE_NAME] = DEFAULT_SERVICE_NAME
    resource = detected.merge(Resource(ours))
    otel_env.check_service_name(resource.attributes.get(SERVICE_NAME))
    return resource
