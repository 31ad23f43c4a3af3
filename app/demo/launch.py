"""Runs a function on N local gloo ranks, or on the ranks torchrun started."""

from __future__ import annotations

import faulthandler
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def under_torchrun() -> bool:
    """Whether this process is one of torchrun's ranks (it sets ``RANK`` and ``WORLD_SIZE``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _entry(
    rank: int, world_size: int, init_file: str, device: str, fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    # A rank that dies in native code (a signal) says where its Python threads were, on stderr.
    faulthandler.enable(all_threads=True)
    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        # Ranks share the machine's cores; more threads than that only contend (and a fixed
        # count keeps CPU results reproducible from run to run).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, device: str = "cpu") -> None:
    """Calls ``fn(*args)`` on every rank with a process group initialized.

    Under torchrun, runs in this process with the backend that fits the machine (NCCL when
    CUDA is available, else gloo); otherwise spawns ``world_size`` local ranks: gloo on the
    CPU, or NCCL with one GPU each when ``device`` is ``"cuda"``.
    """
    if under_torchrun():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
        try:
            fn(*args)
        finally:
            dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = os.path.join(tmp, "rendezvous")
        mp.spawn(_entry, args=(world_size, rendezvous, device, fn, args), nprocs=world_size, join=True)
