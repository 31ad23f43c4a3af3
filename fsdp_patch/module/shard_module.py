"""``fully_shard``: turns a module (or several) into an FSDP unit over a 1-D device mesh, or HSDP's 2-D one.

What a unit does in forward and backward is in :mod:`fsdp_patch.module.unit`; at the end of each
backward the root's final callback installs DTensor views of the main grads as the sharded
parameters' ``.grad``. Between iterations the module holds its sharded parameters, and stays
an ordinary module for everything that reads them: ``state_dict`` (:mod:`.state_dict_hooks`),
optimizers, DCP. Its class becomes a subclass of :class:`~.fsdp_module.FSDPModule`, which
carries the unit's methods.

Alternatives considered:
    - Casting at every all-gather (FSDP2): costs a cast per forward and per backward; a
      persistent compute copy costs memory and a refresh per optimizer step instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils.weak import WeakIdKeyDictionary

from ..mixed_precision import MixedPrecisionPolicy, as_policy
from ..sharding import ParameterGroup, parameter_group_of, record_replaced, register_group, replaced_original
from ..sharding.all_gather_extension import Float8Weight, check_all_gather_extension, float8_weight_of
from ..sharding.placement import MeshDims, mesh_device, post_forward_group, resolve_mesh
from ..sharding.tensor_parallel import TensorParallel, tensor_parallel_of
from .dcp_optimizer_state import track_grad_dtype_mismatch
from .fsdp_module import FSDPModule, fsdp_class, owned_modules
from .grad_scaler_hint import track_fp16_main_grads
from .parameter_placement import Location
from .state_dict_hooks import register_state_dict_hooks
from .unit import UnitState

__all__ = ["fully_shard", "parameter_groups", "unit_name_of"]


def parameter_groups(module: nn.Module) -> list[ParameterGroup]:
    """All parameter groups of the FSDP units in ``module``'s subtree, in module order (a unit
    over several modules once)."""
    states = {id(m._fsdp_state): m._fsdp_state for m in module.modules() if isinstance(m, FSDPModule)}
    return [g for state in states.values() for g in state.groups]


def _fsdp_children(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The FSDP units directly below ``module`` (not inside another unit), with their paths."""
    for prefix, owner in owned_modules(module):
        for name, child in owner._modules.items():
            if isinstance(child, FSDPModule):
                yield f"{prefix}{name}.", child


def _modules_of(module: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """The modules of one ``fully_shard`` call: ``module``, or the list FSDP2 groups into one unit.

    Raises:
        TypeError: Not a module nor a non-empty list of modules.
        ValueError: A module is listed twice, contains another listed one, or is sharded already.
    """
    if isinstance(module, nn.Module):
        modules = [module]
    elif isinstance(module, (list, tuple)) and module and all(isinstance(m, nn.Module) for m in module):
        modules = list(module)
    else:
        got = [type(m).__name__ for m in module] if isinstance(module, (list, tuple)) else type(module).__name__
        raise TypeError(f"fully_shard expected an nn.Module or a non-empty list of them, got {got}")
    for index, first in enumerate(modules):
        if isinstance(first, FSDPModule):
            raise ValueError(
                f"fully_shard was already applied to this {type(first).__name__}; apply it once per module"
            )
        inside = {id(m) for m in first.modules()}
        for other in modules[index + 1 :]:
            if other is first:
                raise ValueError(f"fully_shard: {type(first).__name__} is listed twice; list each module once")
            if id(other) in inside or any(m is first for m in other.modules()):
                raise ValueError(
                    f"fully_shard: of the listed modules, a {type(first).__name__} and a {type(other).__name__} contain "
                    "one another; list modules side by side (apply fully_shard to the inner one first for a unit "
                    "of its own)"
                )
    return modules


def _collect_parameters(
    modules: list[nn.Module], dims: MeshDims, ignored: frozenset[int] = frozenset(), compute_copy: str = "persistent"
) -> tuple[list[nn.Parameter], list[str], dict[int, list[Location]], list[int], list[TensorParallel | None]]:
    """The parameters the unit will own (not owned by an FSDP child), their names from their
    module, their places in the module tree, which of ``modules`` each came from, and how tensor
    parallelism placed each (``None``: a plain parameter); a parameter whose all-gather extension
    fully_shard cannot honor under the policy's ``compute_copy`` is refused."""
    params: list[nn.Parameter] = []
    names: list[str] = []
    owners: list[int] = []
    placed: list[TensorParallel | None] = []
    locations: dict[int, list[Location]] = {}
    owned = ((index, prefix, owner) for index, top in enumerate(modules) for prefix, owner in owned_modules(top))
    for top_index, prefix, owner in owned:
        for name, param in owner._parameters.items():
            if param is None or id(param) in ignored:
                continue
            fqn = f"{prefix}{name}"
            if parameter_group_of(param) is not None:
                raise ValueError(
                    f"parameter '{fqn}' is already sharded by fully_shard on another module; apply "
                    "fully_shard bottom-up (blocks first, then the root), and keep tied parameters "
                    "within one unit"
                )
            if (replaced := replaced_original(param)) is not None:
                raise ValueError(
                    f"parameter '{fqn}' is tied to {replaced}; tied parameters must belong "
                    "to one unit (sharding them in two would silently duplicate them): apply "
                    "fully_shard to a module that contains every use of the parameter"
                )
            if id(param) in locations:
                locations[id(param)].append((owner, name))
                continue
            check_all_gather_extension(fqn, param, compute_copy)
            # A DTensor already: placed by tensor parallelism (refused, naming why, if not as supported).
            tensor_parallel = tensor_parallel_of(fqn, param, dims) if isinstance(param, DTensor) else None
            if param.dim() == 0:
                raise ValueError(
                    f"parameter '{fqn}' is 0-dimensional; fully_shard shards along dim 0 and expects "
                    "at least 1 dimension (store it with shape (1,))"
                )
            if not param.is_floating_point():
                raise ValueError(f"parameter '{fqn}' has dtype {param.dtype}; expected a floating-point dtype")
            params.append(param)
            names.append(fqn)
            owners.append(top_index)
            placed.append(tensor_parallel)
            locations[id(param)] = [(owner, name)]
    return params, names, locations, owners, placed


# Unit module -> its fully qualified name from the outermost unit, as the groups' parameter names
# are ("" for that unit); group -> which of its unit's modules each parameter came from. Weak: the
# unit owns its groups.
_MODULE_PATH: WeakIdKeyDictionary = WeakIdKeyDictionary()
_PARAM_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


_UNIT_MODULE: WeakIdKeyDictionary = WeakIdKeyDictionary()
# Every module fully_shard made a unit, for finding the root above a unit that owns parameters.
_UNITS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def all_units() -> list[nn.Module]:
    """Every live module that ``fully_shard`` made a unit."""
    return list(_UNITS)


def unit_module_of(group: ParameterGroup) -> nn.Module | None:
    """The module ``fully_shard`` made the unit holding ``group``."""
    ref = _UNIT_MODULE.get(group)
    return None if ref is None else ref()


def unit_name_of(group: ParameterGroup) -> str:
    """The fully qualified name of the unit holding ``group`` (``""`` for the root), from the
    outermost unit up the tree, as :attr:`ParameterGroup.names` are."""
    return ", ".join(_MODULE_PATH.get(m, "") for m in _unit_modules_of(group))


def _unit_modules_of(group: ParameterGroup) -> list[nn.Module]:
    """The modules of the unit holding ``group`` (one, or those a list grouped)."""
    module = unit_module_of(group)
    state = None if module is None else getattr(module, "_fsdp_state", None)
    return [] if state is None else list(state.modules)


def _prefix_names(module: nn.Module) -> None:
    """Units are built bottom-up, each naming its parameters from itself; a parent prefixes its
    children's names, so that error messages name parameters from the outermost unit. A
    parameter gets a child's prefix when it came from that child or a module inside it."""
    for prefix, child in _fsdp_children(module):
        inside = {id(m) for m in child.modules()}
        for unit in child.modules():
            if isinstance(unit, FSDPModule):
                path = _MODULE_PATH.get(unit, "")
                _MODULE_PATH[unit] = prefix + path if path else prefix[:-1]
        for group in parameter_groups(child):
            unit_modules = _unit_modules_of(group)
            owners = _PARAM_OWNERS.get(group) or [0] * len(group.names)
            group.names = [
                prefix + name if id(unit_modules[owner]) in inside else name
                for name, owner in zip(group.names, owners, strict=True)
            ]


def _post_forward_size(reshard_after_forward: bool | int | None, mesh_size: int) -> tuple[bool | None, int | None]:
    """``reshard_after_forward`` as a bool (or ``None``), and the size of the groups an int
    asks backward to re-gather over (``None``: the whole mesh), as FSDP2 reads it."""
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return reshard_after_forward, None
    size = reshard_after_forward
    if size < 1 or size > mesh_size or mesh_size % size:
        raise ValueError(
            f"fully_shard: reshard_after_forward as an int is the size of the groups of ranks backward re-gathers "
            f"over and must divide the mesh's size {mesh_size}; got {size}"
        )
    if size == 1:
        return False, None
    if size == mesh_size:
        return True, None
    return True, size


def _ignored_ids(ignored_params: Any) -> frozenset[int]:
    if ignored_params is None:
        return frozenset()
    try:
        ignored = list(ignored_params)
    except TypeError:
        raise TypeError(
            f"fully_shard expected ignored_params to be a set of parameters or None, got {type(ignored_params)!r}"
        ) from None
    wrong = [type(p).__name__ for p in ignored if not isinstance(p, torch.Tensor)]
    if wrong:
        raise TypeError(f"fully_shard expected ignored_params to hold parameters, got {wrong}")
    return frozenset(id(p) for p in ignored)


def _check_offload_policy(offload_policy: Any) -> None:
    if offload_policy is None:
        return
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if isinstance(offload_policy, CPUOffloadPolicy):
        raise NotImplementedError(
            "fully_shard: CPUOffloadPolicy is not supported: the main weights, the compute copy and the main grads "
            "stay on the mesh's device. For CPU offloading use torch.distributed.fsdp.fully_shard "
            "(its FSDP2 models get fsdp_patch's telemetry too)"
        )
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"fully_shard expected offload_policy to be FSDP2's OffloadPolicy() or None, got {offload_policy!r}"
        )


def _check_placements(
    shard_placement_fn: Callable[[nn.Parameter], Any], params: list[nn.Parameter], names: list[str]
) -> None:
    """Refuses, before the module is touched, any placement other than dim 0."""
    if not callable(shard_placement_fn):
        raise TypeError(f"fully_shard expected shard_placement_fn to be callable or None, got {shard_placement_fn!r}")
    for param, name in zip(params, names, strict=True):
        placement = shard_placement_fn(param)
        if placement is None:
            continue
        if isinstance(placement, Shard) and placement.dim % param.dim() == 0:
            continue
        raise NotImplementedError(
            f"fully_shard: shard_placement_fn placed parameter '{name}' as {placement!r}; fully_shard shards every "
            "parameter along dim 0 (each rank holds a run of rows in flat buffers). Return None or Shard(0) for it, "
            "or use torch.distributed.fsdp.fully_shard for other placements and meshes per parameter"
        )


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    """Moves the unit's own buffers to ``device``; buffers on the meta device stay there, for
    ``to_empty`` to materialize with the rest of a meta-built model (see :func:`fully_shard`)."""
    for _, owner in owned_modules(module):
        for name, buffer in owner._buffers.items():
            if buffer is not None and buffer.device != device and not buffer.is_meta:
                owner._buffers[name] = buffer.to(device)


_Modules = TypeVar("_Modules", nn.Module, list[nn.Module])


def fully_shard(
    module: _Modules,
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy | Any | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    offload_policy: Any = None,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
) -> _Modules:
    """Shards ``module``'s parameters over a mesh with fp32 main weights.

    Apply bottom-up: each block first, then the root. A unit owns the parameters that no FSDP
    child owns. A module built under ``torch.device("meta")`` is sharded without being
    materialized: its shards are allocated on the mesh's device (zeros) for an initialization
    after ``fully_shard`` (``to_empty(device=...)``, then ``reset_parameters()``, ``nn.init``
    or ``copy_`` on the sharded parameters), as FSDP2 supports; an all-gather casts them anew. Its parameters become DTensor ``Shard(0)`` parameters (split as ``torch.chunk``
    splits) holding the main weights, with ``grad_dtype`` set to the main-grad dtype; the
    module's class becomes a subclass of :class:`FSDPModule`.

    Args:
        module: Module to shard in place, or a list of modules to shard as one unit (their
            parameters gathered and reduced together), as FSDP2 takes them: the first of them
            to run in a forward gathers, the unit's post-forward follows the last; one the
            root's forward does not run (a head called per chunk of the loss after it) keeps
            the unit gathered until backward, and each call of its own is a forward of the unit.
        mesh: 1-D device mesh (FSDP), or 2-D (HSDP, as FSDP2's: dim 0 replicates, dim 1
            shards; see :mod:`fsdp_patch.sharding.placement`); ``None`` builds a 1-D one over
            the default process group.
        mp_policy: Dtypes of main weights, compute copy and main grads, and the casts of the
            forward's inputs and outputs; torch FSDP2's ``MixedPrecisionPolicy`` is taken as
            the same fields of this one; ``None`` means the defaults.
        reshard_after_forward: ``True``: free the unsharded parameters after forward and
            gather again for backward. ``False``: keep them, registered in the module, until
            the end of the unit's backward (code between forward and backward sees plain
            tensors, as inside forward). ``None`` (the default, as FSDP2's): ``False`` for the
            root of the forward, whose backward starts at once, ``True`` for every other unit.
            A forward without grad (``torch.no_grad()``, evaluation) always frees them.
            An ``int`` (FSDP2's): the size of the groups of consecutive ranks that backward
            re-gathers over; after forward each rank keeps ``1/size`` of the unsharded
            parameters (see ParameterGroup's note on resharding to a smaller group), and the
            module holds the sharded parameters. It must divide the mesh's size; the mesh's
            size itself is ``True``, 1 is ``False``.
        shard_placement_fn: FSDP2's per-parameter placement: ``fn(param)`` returning ``None``
            or ``Shard(0)`` (the placement every parameter gets here); any other placement
            is refused before anything changes.
        offload_policy: FSDP2's ``OffloadPolicy()`` (no offloading) or ``None``;
            ``CPUOffloadPolicy`` is refused.
        ignored_params: Parameters left as they are: not sharded, not moved, their grads not
            reduced (each rank keeps its own), as FSDP2 leaves them.
        dp_mesh_dims: FSDP2's data-parallel dimensions of an SPMD mesh; only ``None``.

    Returns:
        ``module`` (each module of it), now an :class:`FSDPModule`.

    Raises:
        ValueError: ``fully_shard`` was already applied to ``module``, a parameter is tied
            across units, 0-dimensional or not floating point; ``reshard_after_forward`` is an
            int that does not divide the mesh's size.
        NotImplementedError: ``mesh`` has more than 2 dimensions; a parameter is a DTensor
            already (tensor parallel); ``shard_placement_fn`` places a parameter other than on
            dim 0; ``offload_policy`` offloads; ``dp_mesh_dims`` is given.
        TypeError: An argument has the wrong type; a parameter's tensor defines FSDP2's
            all-gather extension (``fsdp_pre_all_gather``/``fsdp_post_all_gather``) and is not
            torchao's tensorwise float8 weight on a plain parameter under a persistent compute
            copy, the one extension ``fully_shard`` honors, by a float8 compute copy (see
            :mod:`fsdp_patch.sharding.all_gather_extension`).
    """
    modules = _modules_of(module)
    mp_policy = as_policy(mp_policy)
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise TypeError(
            f"fully_shard expected reshard_after_forward to be a bool, an int or None, got {reshard_after_forward!r}"
        )
    ignored = _ignored_ids(ignored_params)
    _check_offload_policy(offload_policy)
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            f"fully_shard: dp_mesh_dims={dp_mesh_dims!r} (FSDP2's SPMD mesh whose parameters are DTensors already) is "
            "not supported; pass the data-parallel mesh itself as mesh= and leave dp_mesh_dims None"
        )
    mesh = resolve_mesh(mesh)
    device = mesh_device(mesh)
    dims = MeshDims.of(mesh)
    reshard_after_forward, post_forward_size = _post_forward_size(reshard_after_forward, dims.shard_size)

    params, names, locations, owners, placed = _collect_parameters(modules, dims, ignored, mp_policy.compute_copy)
    if shard_placement_fn is not None:
        _check_placements(shard_placement_fn, params, names)
    # A group per compute dtype, trainability and TP split: a group's flat buffers then hold
    # either elements tensor parallelism splits over its ranks or elements every TP rank holds
    # alike, which the precision diagnostics count differently (summed over TP ranks, or once).
    # torchao's float8 weights form groups of their own, whose compute copy is in float8.
    float8 = [float8_weight_of(param) for param in params]
    by_key: dict[tuple[torch.dtype, bool, bool, Float8Weight | None], list[int]] = {}
    for index, param in enumerate(params):
        split = placed[index] is not None and placed[index].splits  # type: ignore[union-attr]
        key = (mp_policy.compute_dtype_for(param.dtype), param.requires_grad, split, float8[index])
        by_key.setdefault(key, []).append(index)

    # Everything that can fail happens before the module is touched.
    groups: list[ParameterGroup] = []
    group_locations: list[list[list[Location]]] = []
    for (*_, group_float8), indices in by_key.items():
        groups.append(
            ParameterGroup(
                [params[i] for i in indices],
                [names[i] for i in indices],
                mesh,
                mp_policy,
                device,
                [placed[i] for i in indices],
                group_float8,
            )
        )
        group_locations.append([locations[id(params[i])] for i in indices])
        _PARAM_OWNERS[groups[-1]] = [owners[i] for i in indices]

    if post_forward_size is not None:
        regather_group, position = post_forward_group(dims, post_forward_size)
        for group in groups:
            group.unsharding.post_forward_group = (regather_group, position, post_forward_size)

    state = UnitState(modules[0], mesh, mp_policy, reshard_after_forward, groups, group_locations)
    state.modules = modules
    state.swap(unsharded=False)
    for group in groups:
        register_group(group)
        _UNIT_MODULE[group] = weakref.ref(modules[0])
        if group.grads_dtype == torch.float16:
            track_fp16_main_grads(group)
        if group.grads_dtype != group.main_dtype:
            track_grad_dtype_mismatch(group)
    for param, name, owner in zip(params, names, owners, strict=True):
        record_replaced(param, f"parameter '{name}' of an already fully_shard-ed {type(modules[owner]).__name__}")
    # One unit over several modules: each module's own forward hooks (FSDP2's grouped hooks).
    grouped = len(modules) > 1
    pre_forward = state.group_pre_forward if grouped else state.pre_forward
    post_forward = state.group_post_forward if grouped else state.post_forward
    for top in modules:
        _prefix_names(top)
        _move_buffers(top, device)
        top._fsdp_state = state  # type: ignore[assignment]
        _MODULE_PATH[top] = ""
        _UNITS.add(top)
        # First, as FSDP2's: hooks the user registered see the unsharded parameters and cast inputs.
        top.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True)
        top.register_forward_hook(post_forward)
        register_state_dict_hooks(top, state)
        top.__class__ = fsdp_class(type(top))
    return module
