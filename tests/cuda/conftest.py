"""CUDA tests: each runs in a fresh single-rank process group (NCCL) in a spawned process.

Marked ``cuda``; without a CUDA device they skip, saying so. ``scripts/gpu_check.sh`` runs them
(``pytest -m cuda``) whenever a GPU machine is lent.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

NO_CUDA = "no CUDA device here: scripts/gpu_check.sh runs the CUDA tests on a GPU machine"
_TIMEOUT_S = 240


def _rank(fn: Callable[..., Any], args: tuple[Any, ...], init_file: str, backend: str, device: str, out: Any) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch.distributed as dist

    try:
        if device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120)
        )
        try:
            out.put(("ok", pickle.dumps(fn(*args))))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _result(proc: Any, out: Any) -> tuple[str, Any]:
    # Polled, so that a rank that died without a word fails the test at once instead of at the timeout.
    deadline = time.monotonic() + _TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            return out.get(timeout=1)
        except queue.Empty:
            if not proc.is_alive():
                return "error", f"the rank's process exited with code {proc.exitcode} and no result"
    return "error", f"no result within {_TIMEOUT_S} s"


def run_single_rank(fn: Callable[..., Any], *args: Any, backend: str = "nccl", device: str = "cuda") -> Any:
    """``fn(*args)`` in a new process holding a world-size-1 process group; returns its result.

    ``backend="gloo", device="cpu"`` runs the same functions on the CPU (to check the tests
    themselves where no GPU is).
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        proc = ctx.Process(target=_rank, args=(fn, args, os.path.join(tmp, "rendezvous"), backend, device, out))
        proc.start()
        try:
            status, payload = _result(proc, out)
        finally:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    if status == "error":
        raise AssertionError(f"the rank raised:\n{payload}")
    return pickle.loads(payload)


@pytest.fixture
def on_cuda() -> Callable[..., Any]:
    """``on_cuda(fn, *args)``: ``fn(*args)`` on CUDA in a single-rank NCCL group; skips without CUDA."""
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    return run_single_rank
