"""What the training-pattern tests share (``tests/fsdp/test_training_patterns*.py``): the ranks,
the dtypes, the optimizers and backwards a pattern may use, and what torch's FSDP2 (the control)
is known not to train on the installed torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tests.fsdp.pattern_models import sgd

WORLD_SIZE = 2
BF16 = torch.bfloat16

# Patterns whose root returns a dataclass (pattern_models' nets with output="dataclass").
DATACLASS_OUTPUT_PATTERNS = ("output_dataclass", "multi_backward")


def sgd_all(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [sgd(model.parameters())]


def sgd_and_head_bias_apart(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Two optimizers over one group: the head's bias (in the root's group) has its own."""
    bias = model.head.bias
    return [sgd([p for p in model.parameters() if p is not bias]), torch.optim.SGD([bias], lr=0.1)]


def backward_once(output: Any, loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss


def backward_twice(output: Any, loss: torch.Tensor) -> torch.Tensor:
    """Two backwards adding their grads: the loss, then a penalty on the first block's output."""
    aux = 0.1 * output.hidden.float().pow(2).mean()
    loss.backward(retain_graph=True)
    aux.backward()
    return loss + aux.detach()


def raises(fn: Callable[[], Any]) -> str | None:
    """``"Type: message"`` (with notes) of what ``fn`` raised, or None."""
    try:
        fn()
    except Exception as exc:
        notes = " ".join(getattr(exc, "__notes__", []))
        return f"{type(exc).__name__}: {exc} {notes}".strip()
    return None


def _fsdp2_sees_dataclass_outputs() -> bool:
    """Whether torch's FSDP2 finds the tensors inside a dataclass a module returns.

    FSDP2 registers its pre-backward hooks (which re-gather resharded parameters) on the output's
    tensors. Where it finds them with ``collect_grad_tensors`` (torch 2.12 on), it looks inside
    dataclasses; before, it flattened the output with pytree, which keeps an unregistered dataclass
    whole, so no hook is registered and backward meets freed parameters.
    """
    try:
        from torch.distributed.fsdp._common_utils import collect_grad_tensors  # noqa: F401
    except ImportError:
        return False
    return True


# What FSDP2's backward raises when it meets a parameter it resharded without a hook to re-gather it.
_FSDP2_FREED_PARAMETER = re.compile(r"RuntimeError: setStorage: .* out of bounds for storage of size 0")


def fsdp2_limitation(pattern: str, results: dict[str, Any]) -> str | None:
    """Why torch's FSDP2 (the control) cannot train ``pattern`` on this torch, or ``None`` where it can.

    Only a limitation this torch is known to have counts: FSDP2 failing otherwise fails the test.
    """
    error = results["fsdp2"].get("error")
    if error is None or pattern not in DATACLASS_OUTPUT_PATTERNS or _fsdp2_sees_dataclass_outputs():
        return None
    assert _FSDP2_FREED_PARAMETER.search(error), f"FSDP2 failed {pattern} otherwise than its known limitation: {error}"
    return (
        f"torch {torch.__version__}'s FSDP2 does not look inside dataclass outputs for its pre-backward hooks, "
        f"so {pattern} fails under it ({error})"
    )
