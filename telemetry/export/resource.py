"""The resource of the providers the embedded default builds: the ``OTEL_*`` resource plus the rank
identity; and the rank identity as the SDK's resource detector ``fsdp_patch``, for the providers an
SDK configurator builds.

Below both the exporters (the trace-file exporter names the resource in its files, also when the
SDK's configurator constructs it without arguments) and the providers (which give it to the
tracer and meter providers), so that neither has to import the other for it.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.resources import SERVICE_NAME, Resource, ResourceDetector

from .. import semconv
from . import otel_env
from .ranks import RankInfo, known_rank_info

DEFAULT_SERVICE_NAME = "fsdp_patch"


def rank_attributes(rank_info: RankInfo) -> dict[str, Any]:
    """The resource attributes of the rank identity (docs/conventions.md): rank, world size, local
    rank, run id, mesh coordinate."""
    ours: dict[str, Any] = {
        semconv.RESOURCE_RANK: rank_info.rank,
        semconv.RESOURCE_WORLD_SIZE: rank_info.world_size,
        semconv.RESOURCE_LOCAL_RANK: rank_info.local_rank,
    }
    if rank_info.run_id:
        ours[semconv.RESOURCE_RUN_ID] = rank_info.run_id
    if rank_info.mesh_coordinate:
        ours[semconv.RESOURCE_MESH_COORDINATE] = rank_info.mesh_coordinate
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


class RankResourceDetector(ResourceDetector):
    """The rank identity (docs/conventions.md) as a resource detector, the SDK's public seam for
    resource attributes: the entry point ``fsdp_patch`` of the group
    ``opentelemetry_resource_detector``, which ``OTEL_EXPERIMENTAL_RESOURCE_DETECTORS`` names
    (fsdp-patch's distro adds it there).

    An SDK configured at interpreter start (``opentelemetry-instrument``) builds its resource
    before ``init_process_group``: the rank is known then only where torchrun set ``RANK``, and
    an empty resource is detected elsewhere (``mp.spawn``). Spans and metric points carry
    ``fsdp.rank`` as an attribute either way.

    Alternatives considered: updating the resource of the application's providers once the rank is
    known: the SDK has no public way to change a provider's resource (only private methods).
    """

    def detect(self) -> Resource:
        info = known_rank_info()
        return Resource(rank_attributes(info)) if info is not None else Resource.get_empty()
