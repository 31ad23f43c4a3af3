"""fsdp_patch: a minimal Megatron-FSDP path with a mixed-precision optimizer adapter.

``fully_shard`` keeps three sharded copies per parameter group: fp32 main weights the
optimizer updates, a persistent low-precision compute copy forward and backward gather, and
main grads in their own dtype, advertised through ``Tensor.grad_dtype``.
"""

import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"


def _load_checkout_telemetry() -> None:
    # Installed, the repository's top-level telemetry/ folder is fsdp_patch/telemetry
    # (setuptools' package-dir mapping). Run from a source checkout, this package's folder has
    # no telemetry/ inside: load the sibling folder under the same name, so that the checkout
    # being run is the one whose telemetry is used (not an installed copy found by path).
    here = Path(__file__).resolve().parent
    init = here.parent / "telemetry" / "__init__.py"
    if (here / "telemetry").is_dir() or not init.is_file() or f"{__name__}.telemetry" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        f"{__name__}.telemetry", init, submodule_search_locations=[str(init.parent)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise


_load_checkout_telemetry()

from .adapter import cast_buffer_bytes, keep_cast_buffers, remove_fully_shard_optimizer  # noqa: E402
from .forward_methods import register_fsdp_forward_method  # noqa: E402
from .mixed_precision import MixedPrecisionPolicy  # noqa: E402
from .module import FSDPModule, fully_shard, parameter_groups  # noqa: E402
from .sharding import ParameterGroup, contained_in_parameter_group, parameter_group_of  # noqa: E402

__all__ = [
    "FSDPModule",
    "MixedPrecisionPolicy",
    "ParameterGroup",
    "cast_buffer_bytes",
    "contained_in_parameter_group",
    "fully_shard",
    "keep_cast_buffers",
    "parameter_group_of",
    "parameter_groups",
    "register_fsdp_forward_method",
    "remove_fully_shard_optimizer",
]
