"""Where an operation ran: the source line a user would set a breakpoint on, the module, the phase.

The operation audit (:mod:`.op_audit`) sees ATen operations from inside the dispatcher; this
module turns the Python stack at that point into a :class:`Site`:

- the **source line**: the innermost frame of the user's code (anything outside torch and
  fsdp_patch: a training script, a model library such as transformers), with the next such frame
  out as its caller. An operation inside ``torch.optim`` is placed at the optimizer's line, with
  the user's ``optimizer.step()`` as its caller;
- **internal** operations are recognised by the same walk and never judged: those whose innermost
  non-torch frame is fsdp_patch's own (sharding, the adapter, telemetry) or torch.distributed's
  (FSDP2's all-gathers and casts): the mixed precision the user asked for, not a bug;
- the **module**: the innermost module whose forward is running (:class:`ModuleStack`, from
  process-wide forward hooks that exist only while an audit runs), named as the user's model
  names it;
- a **backward** operation has no user frame of its own: the autograd node running it carries the
  site of the forward operation that made the node (:data:`SITE_KEY` in ``node.metadata``).

Alternatives considered:
    - ``traceback.extract_stack`` per operation: it reads every frame's source line from disk;
      the walk here reads code objects, and classifies each file once.
    - A ``TorchFunctionMode`` to tie forward sites to autograd nodes: its presence is guarded by
      torch.compile; the dispatch mode instead ties an output to its node at the next operation,
      when autograd has set ``grad_fn``.
"""

from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["SITE_KEY", "ModuleStack", "Site", "site_here"]

SITE_KEY = "fsdp_patch.op_site"
"""Key of an autograd node's ``metadata`` holding the :class:`Site` of the forward op that made it."""


@dataclass(frozen=True)
class Site:
    """A place in the user's code.

    Attributes:
        file: The source file, relative to the working directory where it is under it.
        line: The line number.
        function: The function's name.
        caller: ``file:line in function`` of the next frame of the user's code out, or ``""``.
        module: The running module's name (``""``: the root, ``None``: no module of a watched model).
        module_type: The running module's class name, or ``""``.
    """

    file: str
    line: int
    function: str
    caller: str = ""
    module: str | None = None
    module_type: str = ""

    @property
    def where(self) -> str:
        """``file:line in function``."""
        return f"{self.file}:{self.line} in {self.function}"


_USER, _TORCH, _OPTIM, _INTERNAL = range(4)


def _package_dir(module: types.ModuleType) -> str:
    return os.path.dirname(os.path.abspath(str(module.__file__))) + os.sep


def _roots() -> tuple[str, tuple[str, ...], str, tuple[str, ...]]:
    import wrapt

    import fsdp_patch

    torch_dir = _package_dir(torch)
    telemetry_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    internal = (_package_dir(fsdp_patch), telemetry_dir, torch_dir + "distributed" + os.sep)
    # Frames that only pass a call on: torch's own, and wrapt's pure-Python wrappers.
    transparent = (torch_dir, _package_dir(wrapt), os.path.dirname(os.__file__) + os.sep + "contextlib.py")
    return torch_dir + "optim" + os.sep, internal, torch_dir, transparent


_OPTIM_DIR, _INTERNAL_DIRS, _TORCH_DIR, _TRANSPARENT = _roots()
_KIND: dict[str, int] = {}


def _kind(filename: str) -> int:
    kind = _KIND.get(filename)
    if kind is None:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        if path.startswith(_OPTIM_DIR):
            kind = _OPTIM
        elif path.startswith(_INTERNAL_DIRS):
            kind = _INTERNAL
        elif path.startswith(_TRANSPARENT):
            kind = _TORCH
        else:
            kind = _USER
        _KIND[filename] = kind
    return kind


def _shown(filename: str) -> str:
    if filename.startswith("<"):
        return filename
    path = os.path.abspath(filename)
    if path.startswith(_TORCH_DIR):
        return "torch/" + path[len(_TORCH_DIR) :]
    here = os.getcwd() + os.sep
    if path.startswith(here):
        return path[len(here) :]
    return filename


def _frame_text(frame: types.FrameType) -> str:
    return f"{_shown(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def site_here(depth: int = 1) -> Site | None:
    """The site of an operation dispatched from the Python stack ``depth`` frames above this call;
    ``None`` for an internal one (fsdp_patch's, torch.distributed's)."""
    frame: types.FrameType | None = sys._getframe(depth + 1)
    optim: types.FrameType | None = None
    user: types.FrameType | None = None
    while frame is not None:
        kind = _kind(frame.f_code.co_filename)
        if kind == _USER:
            user = frame
            break
        if kind == _OPTIM and optim is None:
            optim = frame
        elif kind == _INTERNAL and optim is None:
            return None
        frame = frame.f_back
    if optim is not None:
        called_from = _frame_text(user) if user is not None else ""
        return Site(_shown(optim.f_code.co_filename), optim.f_lineno, optim.f_code.co_name, called_from)
    if user is None:
        return Site("", 0, "")
    caller = user.f_back
    while caller is not None and _kind(caller.f_code.co_filename) != _USER:
        caller = caller.f_back
    called_from = _frame_text(caller) if caller is not None else ""
    return Site(_shown(user.f_code.co_filename), user.f_lineno, user.f_code.co_name, called_from)


class ModuleStack:
    """The modules whose forward is running, innermost last, while installed.

    Args:
        names: Qualified names of the watched models' modules, by identity; a module not among
            them is named by its class.
    """

    def __init__(self, names: dict[int, str]) -> None:
        self._names = names
        self.stack: list[tuple[str | None, str]] = []
        self.roots_ended = 0  # forwards of a watched model's root that returned
        self._handles: list[Any] = []

    def install(self) -> None:
        """Process-wide forward hooks (``nn.modules.module``'s global registry)."""
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._enter),
            nn.modules.module.register_module_forward_hook(self._leave, always_call=True),
        ]

    def remove(self) -> None:
        """Remove the hooks, exactly."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.stack.clear()

    def _enter(self, module: nn.Module, args: Any) -> None:
        self.stack.append((self._names.get(id(module)), type(module).__name__))

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            name, _ = self.stack.pop()
            if name == "" or (name is not None and not self.stack):
                self.roots_ended += 1

    @property
    def current(self) -> tuple[str | None, str]:
        """The innermost running module's (name, class name); ``(None, "")`` outside any."""
        return self.stack[-1] if self.stack else (None, "")

    @property
    def in_model(self) -> bool:
        """Whether a watched model's module is running."""
        return any(name is not None for name, _ in self.stack)
