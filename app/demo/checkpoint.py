"""The demo's checkpoints: DCP for the sharded state, a small JSON file for the rest.

Layout of a checkpoint directory::

    D/step-00000010/          torch.distributed.checkpoint: model and optimizer (DTensor shards)
    D/step-00000010/demo.json  step, data position, LR scheduler, training configuration, world size
    D/latest                   name of the newest complete checkpoint

``demo.json`` is written after every rank finished its DCP files, and ``latest`` after that,
each by rank 0 through a rename: a run killed mid-save leaves ``latest`` on the previous
complete checkpoint. The world size may change on resume (DCP reshards); the training
configuration may not.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fsdp_patch.optimizer import init_optimizer_state

from .config import TrainingConfig
from .options import DemoInputError

LATEST = "latest"
STATE_FILE = "demo.json"
FORMAT = 1  # bumped when demo.json's meaning changes
_PREFIX = "step-"


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step``."""
    return f"{_PREFIX}{step:08d}"


@dataclass(frozen=True)
class SavedState:
    """What a checkpoint holds beside the model and optimizer.

    Attributes:
        path: The checkpoint's directory.
        step: Optimizer steps taken when it was saved.
        data_position: Microbatches of the data stream consumed.
        scheduler: ``LambdaLR.state_dict()``.
        training: The training configuration as saved.
        world_size: Ranks that saved it.
    """

    path: str
    step: int
    data_position: int
    scheduler: dict[str, Any]
    training: dict[str, Any]
    world_size: int


def _write_atomically(path: str, text: str) -> None:
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(partial, path)


def save(
    directory: str,
    step: int,
    data_position: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    training: TrainingConfig,
    keep: int,
) -> str:
    """Save a checkpoint of every rank's shards (collective), then its state file and ``latest``.

    Returns:
        The checkpoint's directory.
    """
    path = os.path.join(directory, checkpoint_name(step))
    dcp.save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
        checkpoint_id=path,
    )
    dist.barrier()
    if dist.get_rank() == 0:
        state = {
            "format": FORMAT,
            "step": step,
            "data_position": data_position,
            "scheduler": scheduler.state_dict(),
            "training": dataclasses.asdict(training),
            "world_size": dist.get_world_size(),
        }
        _write_atomically(os.path.join(path, STATE_FILE), json.dumps(state, indent=1) + "\n")
        _write_atomically(os.path.join(directory, LATEST), checkpoint_name(step) + "\n")
        _prune(directory, keep)
    dist.barrier()
    return path


def _prune(directory: str, keep: int) -> None:
    names = sorted(
        n for n in os.listdir(directory) if n.startswith(_PREFIX) and os.path.isdir(os.path.join(directory, n))
    )
    for name in names[:-keep]:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def find_latest(directory: str) -> SavedState:
    """The newest complete checkpoint in ``directory``, checked for readability.

    Raises:
        DemoInputError: No checkpoint there, or one that is incomplete or not the demo's.
    """
    latest = os.path.join(directory, LATEST)
    if not os.path.isdir(directory):
        raise DemoInputError(f"cannot resume: checkpoint directory {directory} does not exist")
    if not os.path.isfile(latest):
        raise DemoInputError(
            f"cannot resume: no checkpoint in {directory} (expected a '{LATEST}' file written by "
            "`fsdp-patch demo --checkpoint-dir`)"
        )
    with open(latest, encoding="utf-8") as f:
        name = f.read().strip()
    path = os.path.join(directory, name)
    state_file = os.path.join(path, STATE_FILE)
    if not (os.path.isfile(state_file) and os.path.isfile(os.path.join(path, ".metadata"))):
        raise DemoInputError(f"cannot resume: checkpoint {path} is incomplete (no {STATE_FILE} or DCP .metadata)")
    try:
        with open(state_file, encoding="utf-8") as f:
            state = json.load(f)
        if state.get("format") != FORMAT:
            raise DemoInputError(
                f"incompatible checkpoint: {state_file} has format {state.get('format')!r}, this version reads {FORMAT}"
            )
        return SavedState(
            path=path,
            step=int(state["step"]),
            data_position=int(state["data_position"]),
            scheduler=dict(state["scheduler"]),
            training=dict(state["training"]),
            world_size=int(state["world_size"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, DemoInputError):
            raise
        raise DemoInputError(
            f"incompatible checkpoint: {state_file} is not a demo checkpoint's state ({exc})"
        ) from None


def load(
    saved: SavedState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """Load a checkpoint into a freshly built model, adapted optimizer and scheduler (collective)."""
    # The DCP load fills existing state: make it first, neutrally (fsdp_patch's own initializer,
    # since torch's assigns grads of the parameter dtype, which a grad_dtype parameter refuses).
    init_optimizer_state(optimizer)
    model_state = get_model_state_dict(model)
    optim_state = get_optimizer_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=saved.path)
    set_model_state_dict(model, model_state)
    set_optimizer_state_dict(model, optimizer, optim_state)
    scheduler.load_state_dict(saved.scheduler)
