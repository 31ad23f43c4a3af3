"""The float32 shadow of a forward, module by module: what low precision costs each module.

On a shadowed iteration every leaf module of the watched models (a module without children: a
``Linear``, a norm, an embedding, a custom activation) whose output is float16 or bfloat16 runs a
second time as its forward returns, in float32, on float32 copies of the inputs it was given (taken
as its forward began, before an in-place operation could change them), twice:

- with the **fp32 main weights** of its parameters, each unit's gathered in full as the unit's
  forward begins (one all-gather of each sharded parameter of the unit, on every rank alike, as
  FSDP's own) and dropped as it ends;
- with its **compute weights** widened to float32: what the forward computed from.

Measured per module on the device, and read back once as the iteration ends (:meth:`ModuleShadow.finish`):

- its **local error**, ``||out - ref|| / ||ref||``, ``ref`` the recompute from the main weights:
  the error this module adds to what it was given, not what it inherited (the operation audit's
  shadow carries that), against the rounding of its output dtype alone (the unit roundoff: 2^-8
  for bfloat16, 2^-11 for float16);
- the part of it that is the **weights'**, ``||ref_compute - ref|| / ||ref||``: what the compute
  copy rounded away (a scale of 1 + 1e-3 that bfloat16 holds as 1);
- its **headroom**: its largest finite ``|output|`` against the dtype's largest finite value, and
  the share of elements float32 keeps non-zero below the dtype's smallest normal (those the dtype
  flushes or holds with few bits);
- the elements that are NaN/Inf where float32 stays finite.

The user's model is left exactly as it was. The recompute runs on a shallow copy of the module whose
parameters and buffers are float32 copies (a norm's running statistics, an attribute the forward
sets, stay on the copy), without hooks (the class's ``forward`` is called, not the module), under
``no_grad``, with autocast and every dispatch mode (the operation audit's) off, inside a fork of the
random-number generators. A module whose forward drew random numbers (dropout) is not recomputed:
float32 would draw others. Forwards run inside the backward (an activation checkpoint's recompute)
are not shadowed, and at most ``max_calls`` leaf calls an iteration are.

Alternatives considered:
    - A shadow carried from the model's input (the operation audit's): it shows where accumulated
      error appears, not which module adds it; the local error ranks modules by their own cost.
    - Recomputing whole units: their children's hooks (FSDP's own, the user's) would run again.
    - Gathering every main weight as the iteration starts: the whole model in float32 on every
      rank; a unit at a time is what FSDP itself holds.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from fsdp_patch.module.model_units import ShardedModel, is_sharded_unit, user_name

from .full_weights import full_weight
from .op_stats import LOW_PRECISION

__all__ = ["ModuleCost", "ModuleShadow"]

# Per leaf call, on the device: squared errors and norms, the largest |output|, counts.
_ERR_SQ, _REF_SQ, _WEIGHT_ERR_SQ, _AMAX, _TINY, _NUMEL, _NONFINITE = range(7)
_SLOTS = 7


@dataclass(frozen=True)
class ModuleCost:
    """What low precision cost one module over a shadowed iteration (all its calls).

    Attributes:
        module: Its qualified name.
        module_type: Its class's name.
        dtype: Its output's dtype.
        error: ``||out - ref|| / ||ref||`` against the recompute from the fp32 main weights.
        weight_error: ``||ref_compute - ref|| / ||ref||``: the part the compute weights make.
        rounding: The output dtype's unit roundoff: what rounding the result alone costs.
        headroom: Largest finite ``|output|`` over the dtype's largest finite value.
        underflow: Share of elements non-zero in float32 and below the dtype's smallest normal.
        nonfinite: Elements NaN/Inf in the output where float32 is finite.
        calls: Forward calls measured.
        elements: Output elements measured.
    """

    module: str
    module_type: str
    dtype: torch.dtype
    error: float
    weight_error: float
    rounding: float
    headroom: float
    underflow: float
    nonfinite: int
    calls: int
    elements: int

    @property
    def cost(self) -> float:
        """The local error in units of the dtype's rounding (``inf`` for a non-finite output)."""
        return math.inf if self.nonfinite else self.error / self.rounding


@dataclass
class _Call:
    """A leaf's forward in flight, as it began: float32 copies of its inputs, of the compute weights
    and the buffers it reads (a unit that is a leaf reshards before its forward hooks run, and a
    norm's forward updates its running statistics), and the generators' states."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    weights: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor | None]
    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None


def _floating(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _widened(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().to(torch.float32, copy=True)
    return value


def _copies(tensors: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """Copies of a module's parameters or buffers, floating ones in float32."""
    return {
        name: None if t is None else _widened(t) if t.is_floating_point() else t.detach().clone()
        for name, t in tensors.items()
    }


def _class_name(module: nn.Module) -> str:
    """The module's own class's name, not the one FSDP made to wrap it (``FSDPLinear``: ``Linear``)."""
    if not is_sharded_unit(module):
        return type(module).__name__
    wrappers = tuple(c for c in type(module).__mro__ if c.__name__ == "FSDPModule")
    return next((c.__name__ for c in type(module).__mro__ if not issubclass(c, wrappers)), type(module).__name__)


def _is_leaf(module: nn.Module) -> bool:
    return next(module.children(), None) is None


def _cuda_state(device: torch.device | None) -> torch.Tensor | None:
    if device is None or device.type != "cuda":
        return None
    return torch.cuda.get_rng_state(device)


@contextlib.contextmanager
def _quiet(device: torch.device) -> Iterator[None]:
    """No grad, no autocast, no dispatch mode, and the generators left as they were."""
    devices = [device] if device.type == "cuda" else []
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=devices))
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.autocast("cpu", enabled=False))
        if device.type == "cuda":
            stack.enter_context(torch.autocast("cuda", enabled=False))
        stack.enter_context(_disable_current_modes())
        yield


class ModuleShadow:
    """The float32 shadow of one iteration's forwards (see the module).

    Args:
        models: The sharded models to shadow.
        max_calls: Leaf calls measured at most: later ones run as they would.

    Attributes:
        failed: Modules whose recompute could not run, with the error (never raised).
    """

    def __init__(self, models: Sequence[ShardedModel], max_calls: int = 4000) -> None:
        self._models = list(models)
        self.max_calls = max_calls
        self.failed: dict[str, str] = {}
        self._handles: list[Any] = []
        self._unit_params: dict[int, list[tuple[int, str, DTensor]]] = {}
        self._full: dict[tuple[int, str], torch.Tensor] = {}
        self._names: dict[int, str] = {}
        self._calls: dict[int, list[_Call | None]] = {}
        self._stats: list[tuple[str, str, torch.dtype, torch.Tensor]] = []
        self._measured = 0
        self._running = False
        self._gathering = True

    # -- life cycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Register the hooks: from here on, each unit's main weights are gathered as its forward
        begins and each leaf's forward is shadowed."""
        units: list[nn.Module] = []
        for model in self._models:
            owner: dict[int, nn.Module] = {}
            for _, unit in model.units:  # outer units first: an inner one owns its own modules
                units.append(unit)
                for module in unit.modules():
                    owner[id(module)] = unit
            for name, module in model.named_modules():
                holder = owner.get(id(module))
                for param_name, param in module._parameters.items():
                    if isinstance(param, DTensor) and holder is not None:
                        self._unit_params.setdefault(id(holder), []).append((id(module), param_name, param))
                if _is_leaf(module):
                    self._names.setdefault(id(module), user_name(model.prefix, name))
        # Forward pre-hooks and hooks run in the order they were registered: a unit's gather before
        # a leaf's (the unit may be a leaf), a leaf's measurement before its unit's release.
        leaves = [m for model in self._models for _, m in model.named_modules() if id(m) in self._names]
        for unit in units:
            self._handles.append(unit.register_forward_pre_hook(self._gather))
        for leaf in {id(m): m for m in leaves}.values():
            self._handles.append(leaf.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._handles.append(leaf.register_forward_hook(self._leave, with_kwargs=True, always_call=True))
        for unit in units:
            self._handles.append(unit.register_forward_hook(self._release, always_call=True))
        self._running = True

    def stop(self) -> None:
        """Remove every hook and drop the gathered weights and the inputs held."""
        self._running = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._full.clear()
        self._calls.clear()

    def finish(self) -> list[ModuleCost]:
        """Stop, read the statistics back (one copy) and sum them per module, costliest first."""
        self.stop()
        if not self._stats:
            return []
        device = self._stats[0][3].device
        values = torch.stack([s.to(device) for *_, s in self._stats]).cpu().tolist()
        merged: dict[str, tuple[str, torch.dtype, list[float], int]] = {}
        for (name, module_type, dtype, _), row in zip(self._stats, values, strict=True):
            held = merged.get(name)
            if held is None:
                merged[name] = (module_type, dtype, list(row), 1)
                continue
            total = held[2]
            for slot, value in enumerate(row):
                total[slot] = max(total[slot], value) if slot == _AMAX else total[slot] + value
            merged[name] = (held[0], held[1], total, held[3] + 1)
        costs = []
        for name, (module_type, dtype, row, calls) in merged.items():
            ref = math.sqrt(row[_REF_SQ])
            finfo = torch.finfo(dtype)
            costs.append(
                ModuleCost(
                    module=name,
                    module_type=module_type,
                    dtype=dtype,
                    error=math.sqrt(row[_ERR_SQ]) / ref if ref > 0 else 0.0,
                    weight_error=math.sqrt(row[_WEIGHT_ERR_SQ]) / ref if ref > 0 else 0.0,
                    rounding=finfo.eps / 2,
                    headroom=row[_AMAX] / finfo.max,
                    underflow=row[_TINY] / row[_NUMEL] if row[_NUMEL] else 0.0,
                    nonfinite=int(row[_NONFINITE]),
                    calls=calls,
                    elements=int(row[_NUMEL]),
                )
            )
        return sorted(costs, key=lambda c: (-c.cost, c.module))

    # -- hooks ---------------------------------------------------------------------------------

    def _shadowing(self) -> bool:
        return self._running and torch._C._current_autograd_node() is None

    def _gather(self, unit: nn.Module, args: Any) -> None:
        # Every rank runs the same unit forwards (FSDP's all-gathers need it too), so every rank
        # issues these gathers alike; nothing rank-local decides whether they run.
        if not self._shadowing() or not self._gathering:
            return
        try:
            with torch.no_grad(), _disable_current_modes():
                for module_id, name, param in self._unit_params.get(id(unit), ()):
                    self._full[(module_id, name)] = full_weight(param).to(torch.float32)
        except Exception as exc:  # a layout the gather cannot read (offloaded shards): never raised
            # A failure of this kind is every rank's alike, so they all stop gathering here; the
            # leaves go on from their compute weights.
            self._gathering = False
            self.failed.setdefault("(the main weights' gather)", f"{type(exc).__name__}: {exc}"[:200])

    def _release(self, unit: nn.Module, args: Any, output: Any) -> None:
        for module_id, name, _ in self._unit_params.get(id(unit), ()):
            self._full.pop((module_id, name), None)

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        stack = self._calls.setdefault(id(module), [])
        if not self._shadowing() or self._measured >= self.max_calls:
            stack.append(None)
            return
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(isinstance(t, DTensor) for t in inputs):  # tensor parallelism: its own layout
            stack.append(None)
            return
        if any(isinstance(p, DTensor) for p in module._parameters.values()):
            stack.append(None)
            return
        device = next((t.device for t in inputs), None)
        try:
            with torch.no_grad(), _disable_current_modes():
                call: _Call | None = _Call(
                    tree_map(_widened, args),
                    tree_map(_widened, kwargs),
                    _copies(module._parameters),
                    _copies(module._buffers),
                    torch.get_rng_state(),
                    _cuda_state(device),
                )
        except Exception as exc:  # inputs the copy cannot widen: counted, never raised
            self.failed.setdefault(
                self._names.get(id(module), _class_name(module)), f"{type(exc).__name__}: {exc}"[:200]
            )
            call = None
        stack.append(call)

    def _leave(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        stack = self._calls.get(id(module))
        call = stack.pop() if stack else None
        if call is None:
            return
        outputs = _floating(output)
        index = next((i for i, t in enumerate(outputs) if t.dtype in LOW_PRECISION), None)
        if index is None:
            return
        out = outputs[index]
        drew = not torch.equal(torch.get_rng_state(), call.cpu_rng) or (
            call.cuda_rng is not None and not torch.equal(_cuda_state(out.device), call.cuda_rng)  # type: ignore[arg-type]
        )
        if drew:  # dropout and its kind: float32 would draw other numbers
            return
        self._measured += 1
        name = self._names.get(id(module), _class_name(module))
        try:
            with _quiet(out.device):
                from_main = _floating(self._recompute(module, call, main=True))
                from_compute = _floating(self._recompute(module, call, main=False)) if module._parameters else from_main
                if len(from_main) != len(outputs) or from_main[index].shape != out.shape:
                    raise ValueError("its float32 recompute returned other outputs")
                stats = _stats(out.detach(), from_main[index], from_compute[index])
        except Exception as exc:  # a module the recompute cannot run: counted, never raised
            self.failed.setdefault(name, f"{type(exc).__name__}: {exc}"[:200])
            return
        self._stats.append((name, _class_name(module), out.dtype, stats))

    def _recompute(self, module: nn.Module, call: _Call, main: bool) -> Any:
        # A shallow copy by hand: FSDP modules refuse copy.copy (it pickles), and nothing of the
        # module's own is written through the copy's new parameter and buffer dicts.
        shadow = nn.Module.__new__(type(module))
        shadow.__dict__.update(module.__dict__)
        params: dict[str, Any] = {}
        for name, compute in call.weights.items():
            full = self._full.get((id(module), name)) if main else None
            params[name] = compute if full is None or compute is None or full.shape != compute.shape else full
        shadow._parameters = params
        shadow._buffers = {name: None if b is None else b.clone() for name, b in call.buffers.items()}
        return type(module).forward(shadow, *tree_map(_widened, call.args), **tree_map(_widened, call.kwargs))


def _stats(out: torch.Tensor, ref: torch.Tensor, ref_compute: torch.Tensor) -> torch.Tensor:
    """One leaf call's statistics (the ``_ERR_SQ`` .. slots), float64 on the output's device."""
    wide, ref = out.to(torch.float32), ref.to(torch.float32)
    ref_finite = torch.isfinite(ref)
    finite = torch.isfinite(wide) & ref_finite
    zero = torch.zeros((), dtype=torch.float32, device=out.device)
    both = finite & torch.isfinite(ref_compute)
    tiny = torch.finfo(out.dtype).tiny
    stats = torch.stack(
        [
            torch.where(finite, wide - ref, zero).double().square().sum(),
            torch.where(finite, ref, zero).double().square().sum(),
            torch.where(both, ref_compute.to(torch.float32) - ref, zero).double().square().sum(),
            torch.where(torch.isfinite(wide), wide.abs(), zero).max().double() if wide.numel() else zero.double(),
            ((ref != 0) & (ref.abs() < tiny)).sum().double(),
            torch.tensor(float(out.numel()), dtype=torch.float64, device=out.device),
            (~torch.isfinite(wide) & ref_finite).sum().double(),
        ]
    )
    assert stats.numel() == _SLOTS
    return stats
