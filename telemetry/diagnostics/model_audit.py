"""Low precision beyond the parameters: buffers, the loss, normalization statistics, accumulated
main grads, and main weights rebuilt from their compute copy.

The dtype-contract audit (:mod:`.dtype_contract`) checks what the optimizer holds. A
mixed-precision bug is as often in what it does not hold: a RoPE ``inv_freq`` buffer that
``model.bfloat16()`` rounded, a cross entropy computed on bfloat16 logits, an RMSNorm whose
variance is a bfloat16 mean, microbatches summed into bfloat16 main grads, or fp32 master
weights restored from the bfloat16 copy at a resume. Each check here runs once (at the first
step, the first backward, the first forward, or after a load), never per step. No OpenTelemetry
here.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fsdp_patch.module.model_units import user_name

from .. import semconv

LOW_PRECISION = (torch.bfloat16, torch.float16)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ModelFinding:
    """One tensor of the model in a dtype too narrow for its role.

    Attributes:
        tensor: Its role: one of ``semconv.MODEL_AUDIT_TENSORS``.
        where: A buffer's or module's fully qualified name, the loss's last operation, or a unit.
        expected: The dtype its role needs.
        actual: The dtype found.
        detail: What it does, and the fix.
    """

    tensor: str
    where: str
    expected: torch.dtype
    actual: torch.dtype
    detail: str


# -- buffers -----------------------------------------------------------------------------------


def low_precision_buffers(root: nn.Module, prefix: str = "") -> list[ModelFinding]:
    """Floating buffers of ``root`` in bfloat16/float16 (``model.bfloat16()`` casts buffers too),
    named as the module holding ``root`` names them (``prefix``: :func:`fsdp_patch.module.model_units.holder_prefix`)."""
    found = []
    for name, buffer in root.named_buffers(prefix=prefix[:-1]):
        if buffer is None or not buffer.is_floating_point() or buffer.dtype not in LOW_PRECISION:
            continue
        found.append(
            ModelFinding(
                semconv.TENSOR_BUFFER,
                name,
                torch.float32,
                buffer.dtype,
                f"a buffer rounded to {_name(buffer.dtype)} (model.{_name(buffer.dtype)}() casts buffers too; a RoPE "
                "inv_freq loses position precision this way): keep buffers in float32, e.g. buffer.data = "
                "buffer.data.float() after the cast, and cast the parameters only",
            )
        )
    return found


# -- the loss ----------------------------------------------------------------------------------

# Operations a loss is often wrapped in after it is computed: the first other node, walking back
# from the loss, is where the loss was computed.
_PASS_THROUGH = (
    "ToCopyBackward",
    "MeanBackward",
    "SumBackward",
    "DivBackward",
    "MulBackward",
    "AddBackward",
    "ViewBackward",
    "SqueezeBackward",
    "UnsqueezeBackward",
    "CloneBackward",
    "ExpandBackward",
)
_SAVED = ("_saved_self", "_saved_result", "_saved_other", "_saved_input")


def _saved_dtype(node: Any) -> torch.dtype | None:
    for attribute in _SAVED:
        try:
            saved = getattr(node, attribute)
        except (AttributeError, RuntimeError):  # absent, or freed by an earlier backward
            continue
        if isinstance(saved, torch.Tensor) and saved.is_floating_point():
            return saved.dtype
    return None


def loss_precision(loss: torch.Tensor) -> ModelFinding | None:
    """Whether the loss was computed in bfloat16/float16: its dtype, or that of the first operation
    behind the casts and reductions it is wrapped in (``cross_entropy(logits).float()``)."""
    if loss.dtype in LOW_PRECISION:
        return ModelFinding(
            semconv.TENSOR_LOSS,
            _op(loss.grad_fn),
            torch.float32,
            loss.dtype,
            f"the loss is {_name(loss.dtype)}: compute it in float32 (cross_entropy(logits.float(), labels))",
        )
    node, depth = loss.grad_fn, 0
    while node is not None and depth < 8:
        name = type(node).__name__
        if not name.startswith(_PASS_THROUGH):
            dtype = _saved_dtype(node)
            if dtype in LOW_PRECISION:
                assert dtype is not None
                return ModelFinding(
                    semconv.TENSOR_LOSS,
                    _op(node),
                    torch.float32,
                    dtype,
                    f"the loss was computed from {_name(dtype)} values ({_op(node)}) and cast after: cast its "
                    "input to float32 before the loss (cross_entropy(logits.float(), labels))",
                )
            return None
        following = [f for f, _ in node.next_functions if f is not None]
        node, depth = (following[0] if following else None), depth + 1
    return None


def _op(node: Any) -> str:
    return type(node).__name__.removesuffix("0").removesuffix("Backward") if node is not None else "loss"


# -- normalization statistics ----------------------------------------------------------------------

# Reductions a normalization's statistics are made of.
_STATISTICS = frozenset({"mean", "var", "std", "var_mean", "std_mean", "rsqrt", "sqrt", "pow", "square", "norm"})
# torch.nn's own normalizations compute their statistics in float32 for bfloat16/float16 input.
_NATIVE = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.batchnorm._NormBase,
    nn.LocalResponseNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)


def _is_custom_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower() and not isinstance(module, _NATIVE)


class _Reductions(TorchFunctionMode):
    """Notes the low-precision statistics a module's forward computes."""

    def __init__(self, seen: Callable[[str, torch.dtype], None]) -> None:
        super().__init__()
        self._seen = seen

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _STATISTICS and args and isinstance(args[0], torch.Tensor) and args[0].dtype in LOW_PRECISION:
            self._seen(name, args[0].dtype)
        return func(*args, **(kwargs or {}))


class NormStatistics:
    """Watches the first training forward of every custom normalization module of ``root`` (a class
    named ``*Norm*`` that is not one of torch.nn's) for statistics computed in bfloat16/float16.

    :attr:`findings` holds one per module found; :attr:`done` turns true after that forward, when
    the hooks are gone.
    """

    def __init__(self, root: nn.Module, prefix: str = "") -> None:
        self.findings: list[ModelFinding] = []
        self.done = False
        self._active: list[tuple[str, TorchFunctionMode]] = []
        self._named: set[str] = set()
        self._handles = []
        modules = [(user_name(prefix, name), m) for name, m in root.named_modules() if _is_custom_norm(m)]
        for name, module in modules:
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._enter, name)))
            self._handles.append(module.register_forward_hook(functools.partial(self._exit, name), always_call=True))
        self._handles.append(root.register_forward_hook(self._root_done, always_call=True))
        if not modules:
            self.remove()

    def _enter(self, name: str, module: nn.Module, args: Any) -> None:
        if self.done:
            self.remove()  # a pre-hook of a module, not the root's post-hooks: safe to remove now
            return
        if not torch.is_grad_enabled():
            return
        mode = _Reductions(functools.partial(self._seen, name))
        mode.__enter__()
        self._active.append((name, mode))

    def _exit(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        if self.done:
            return
        if self._active and self._active[-1][0] == name:
            _, mode = self._active.pop()
            mode.__exit__(None, None, None)

    def _seen(self, name: str, op: str, dtype: torch.dtype) -> None:
        if name in self._named:
            return
        self._named.add(name)
        self.findings.append(
            ModelFinding(
                semconv.TENSOR_NORM_STATISTICS,
                name,
                torch.float32,
                dtype,
                f"its statistics are computed in {_name(dtype)} ({op}): a mean of squares in {_name(dtype)} loses "
                "precision (and overflows in float16); compute them in float32 (x.float().pow(2).mean(...)), or use "
                "torch.nn.RMSNorm / LayerNorm, which do",
            )
        )

    def _root_done(self, module: nn.Module, args: Any, output: Any) -> None:
        # Runs inside the root's forward hooks, also when the forward raised: torch then iterates
        # over the root's hook dict itself, so removing a hook here would replace the user's error
        # with "OrderedDict mutated during iteration". The hooks go inert now and are removed by
        # the next _enter (or remove()), outside any iteration over the root's hooks.
        if torch.is_grad_enabled():
            self._finish()

    def _finish(self) -> None:
        while self._active:
            self._active.pop()[1].__exit__(None, None, None)
        self.done = True

    def remove(self) -> None:
        self._finish()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


# -- what the optimizer's groups say -----------------------------------------------------------------


def low_precision_accumulation(
    groups: Iterable[tuple[str, torch.dtype | None]], microbatches: int
) -> list[ModelFinding]:
    """Groups whose grads sum ``microbatches`` backward passes in bfloat16/float16.

    Args:
        groups: ``(unit, dtype the grads accumulate in)`` per group (``None``: not known).
        microbatches: Backward passes of one step.
    """
    if microbatches < 2:
        return []
    found = []
    for unit, dtype in groups:
        if dtype not in LOW_PRECISION:
            continue
        assert dtype is not None
        bits = round(-math.log2(torch.finfo(dtype).eps)) + 1  # significand bits: 8 for bfloat16
        found.append(
            ModelFinding(
                semconv.TENSOR_GRAD_ACCUMULATION,
                unit,
                torch.float32,
                dtype,
                f"{microbatches} microbatches summed into {_name(dtype)} grads: each addition rounds to {bits} bits, "
                f"an error of up to about {microbatches} x 2^-{bits} of the sum; accumulate in float32 (fully_shard: "
                "MixedPrecisionPolicy(main_grads_dtype=torch.float32); torch FSDP2: "
                "MixedPrecisionPolicy(reduce_dtype=torch.float32))",
            )
        )
    return found


def rebuilt_from_compute(params: Sequence[tuple[str, torch.Tensor, torch.dtype]], since: str) -> ModelFinding | None:
    """Whether every main weight is exactly a value of its compute dtype: fp32 master weights
    rebuilt from their bfloat16/float16 copy.

    Args:
        params: ``(name, main weight shard, compute dtype)`` of the parameters whose compute dtype
            is narrower than their main dtype.
        since: When they were written: a resume (``"a resume from step N"``) or a write between
            steps (``"a write between steps N and N+1"``). The check needs one: a fresh run of a
            model cast to bfloat16 before sharding starts on that grid by design.
    """
    if not params:
        return None
    elements = 0
    for _, main, compute_dtype in params:
        if main.numel() == 0:
            continue
        if not torch.equal(main.to(compute_dtype).to(main.dtype), main):
            return None
        elements += main.numel()
    if not elements:
        return None
    name, main, compute_dtype = params[0]
    return ModelFinding(
        semconv.TENSOR_MAIN_WEIGHT,
        name,
        main.dtype,
        compute_dtype,
        f"every main weight is exactly a {_name(compute_dtype)} value after {since}: the fp32 master weights were "
        f"rebuilt from the {_name(compute_dtype)} copy, and every update below its resolution since they were last "
        "saved is lost; save and load the fp32 main weights (the sharded model's state dict through "
        "torch.distributed.checkpoint), not the compute copy",
    )


# -- optimizer state restored through a lower precision -----------------------------------------------

# Elements a state must have that are not 0 before its values being all of a low-precision dtype
# says anything: a float32 value picked at random is a bfloat16 one with odds 2**-16.
STATE_EVIDENCE = 64


def state_through_low_precision(states: Sequence[tuple[str, str, torch.Tensor]], since: str) -> ModelFinding | None:
    """Whether every value of the optimizer's float32 state is a bfloat16 (or float16) value: state
    that went through that dtype on its way back (a checkpoint that saved it cast, or a load into
    parameters of that dtype, which ``Optimizer.load_state_dict`` casts state to).

    Args:
        states: ``(parameter name, state key, local state tensor)`` of the optimizer's state.
        since: When it was written (``"a resume from step N"``).
    """
    wide = [(name, key, t) for name, key, t in states if t.dtype == torch.float32 and t.numel() > 1]
    evidence = sum(int(torch.count_nonzero(t)) for _, _, t in wide)
    if evidence < STATE_EVIDENCE:
        return None
    for dtype in LOW_PRECISION:
        if all(torch.equal(t.to(dtype).to(t.dtype), t) for _, _, t in wide):
            name, key, _ = wide[0]
            return ModelFinding(
                semconv.TENSOR_OPTIMIZER_STATE,
                f"{name} {key}",
                torch.float32,
                dtype,
                f"every value of the optimizer's float32 state ({len(wide)} tensors, {key} of {name} the first) is "
                f"a {_name(dtype)} value after {since}: the state went through {_name(dtype)} on its way back (a "
                f"checkpoint that saved it cast, or Optimizer.load_state_dict into {_name(dtype)} parameters, which "
                "casts state to each parameter's dtype), and lost what the moments held below that resolution; save "
                "and load the state in float32 (through torch.distributed.checkpoint, with the fp32 main weights)",
            )
    return None


MOMENTS_BROKEN_SHARE = 0.01
"""Share of the elements with a non-zero ``exp_avg`` whose ``exp_avg_sq`` is 0, above which the
second moment lost its small values (and at least :data:`STATE_EVIDENCE` such elements)."""


def moments_inconsistent(states: Sequence[tuple[str, str, torch.Tensor]], since: str) -> ModelFinding | None:
    """Whether Adam's second moment is 0 where its first is not, which no run of grads makes: a
    second moment of 0 means every grad so far was 0, and then the first moment is 0 too. State
    like this lost the second moment's small values on its way back (float16 flushes them below
    6e-8: a checkpoint that saved ``exp_avg_sq`` cast), and the next update of those elements
    divides ``exp_avg`` by eps alone. Needs no history: a run resumed in a new process is judged
    at its first step.

    Args:
        states: ``(parameter name, state key, local state tensor)`` of the optimizer's state.
        since: When it was written (``"a resume from step N"``).
    """
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for name, key, t in states:
        moments.setdefault(name, {})[key] = t
    broken, moving, first = 0, 0, ""
    for name, held in moments.items():
        m, v = held.get("exp_avg"), held.get("exp_avg_sq")
        if m is None or v is None or m.shape != v.shape:
            continue
        nonzero = m != 0
        count = int(torch.count_nonzero(nonzero & (v == 0)))
        moving += int(torch.count_nonzero(nonzero))
        broken += count
        first = first or (name if count else "")
    if broken < STATE_EVIDENCE or broken <= MOMENTS_BROKEN_SHARE * moving:
        return None
    return ModelFinding(
        semconv.TENSOR_OPTIMIZER_STATE,
        f"{first} exp_avg_sq",
        torch.float32,
        torch.float16,
        f"after {since}, exp_avg_sq is exactly 0 where exp_avg is not in {broken} of {moving} elements "
        f"({broken / moving:.1%}; {first} the first): Adam's moments cannot be so (a second moment of 0 means "
        "every grad was 0, and the first would be 0 too). The second moment lost its small values on its way back "
        "(float16 flushes them below 6e-8: a checkpoint that saved it cast), and the next update of those elements "
        "divides exp_avg by eps alone; save and load the state in float32",
    )
