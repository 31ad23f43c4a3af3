"""A pool of ranks that stays up across tests, so each test pays no process start-up.

Gloo on the CPU by default; ``backend="nccl"`` gives each rank the GPU of its index.

``pool.run(fn, *args)`` runs ``fn(*args)`` on every rank (``fn`` must be importable at module
level) and returns the per-rank results. An exception on any rank is re-raised here with the
rank's traceback; a rank that hangs makes the pool restart and the call fail, after printing its
stacks (every thread) on stderr and naming the ranks that answered and what the others raised;
so does a rank whose process dies (a crash in native code), as soon as it is gone, with its exit
status; its Python traceback at a fatal signal is on its stderr (``faulthandler``).
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

_TIMEOUT_S = float(os.environ.get("FSDP_PATCH_TEST_TIMEOUT", "240"))
_POLL_S = 1.0  # how often a wait for results checks that every rank is still alive
_STACKS_SIGNAL = signal.SIGUSR1


def _worker(rank: int, world_size: int, backend: str, init_file: str, inbox: mp.Queue, outbox: mp.Queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    faulthandler.enable()  # a crash in native code prints where Python was, on every thread
    # A rank that hangs is asked for its stacks (every thread) before the pool kills it.
    faulthandler.register(_STACKS_SIGNAL, all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=_TIMEOUT_S / 2),
    )
    outbox.put((rank, "ready", None))
    while True:
        job = inbox.get()
        if job is None:
            break
        try:
            # Unpickled here, so that a body whose module fails to import on the rank is an
            # error of this call (with the ImportError) rather than a rank that dies silently.
            fn, args, kwargs = pickle.loads(job)
            result = fn(*args, **kwargs)
            # Pickled here, not in the queue's feeder thread, so that an unpicklable result
            # is an error of this call rather than a hang.
            outbox.put((rank, "ok", pickle.dumps(result)))
        except BaseException as exc:
            outbox.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


def _exit_status(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class RankError(AssertionError):
    """An exception raised on a rank, with that rank's traceback."""


class DistributedPool:
    def __init__(self, world_size: int, backend: str = "gloo") -> None:
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = _TIMEOUT_S  # how long a call waits for every rank's answer
        self._procs: list[mp.Process] = []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory()
        init_file = os.path.join(self._tmp.name, "rendezvous")
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        self._outbox = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, self.backend, init_file, self._inboxes[r], self._outbox),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()
        self._collect(starting=True)

    def _collect(self, starting: bool = False) -> list[Any]:
        """Every rank's answer. On a failure the pool is rebuilt for the next call; while
        ``starting``, it is only closed (rebuilding a pool whose ranks cannot start would recurse)."""
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        timeout_s = _TIMEOUT_S if starting else self.timeout_s
        deadline = time.monotonic() + timeout_s
        while len(results) + len(errors) < self.world_size:
            try:
                rank, status, payload = self._outbox.get(timeout=_POLL_S)
            except queue.Empty:
                waiting = sorted(set(range(self.world_size)) - set(results) - set(errors))
                dead = {r: self._procs[r].exitcode for r in waiting if self._procs[r].exitcode is not None}
                if dead:
                    self._after_failure(starting)
                    raise RankError(
                        "; ".join(f"rank {r} died ({_exit_status(code)})" for r, code in dead.items())
                        + ", see its stderr"
                    ) from None
                if time.monotonic() > deadline:
                    self._dump_stacks(waiting)
                    self._after_failure(starting)
                    raised = "".join(f"\nrank {r} raised:\n{errors[r]}" for r in sorted(errors))
                    raise RankError(
                        f"ranks {waiting} timed out after {timeout_s:.0f} s (their stacks are on stderr)"
                        + (f"; ranks {sorted(results)} answered" if results else "")
                        + raised
                    ) from None
                continue
            if status == "error":
                errors[rank] = payload
                # A rank that failed inside a collective leaves its peers waiting for the gloo
                # timeout; they report too, then the pool is rebuilt.
            elif status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                results[rank] = payload
        if errors:
            self._after_failure(starting)
            first = min(errors)
            raise RankError(f"rank {first} raised:\n{errors[first]}")
        return [results[r] for r in range(self.world_size)]

    def _dump_stacks(self, ranks: list[int]) -> None:
        for r in ranks:
            pid = self._procs[r].pid
            if pid is not None and self._procs[r].is_alive():
                os.kill(pid, _STACKS_SIGNAL)
        time.sleep(1.0)  # faulthandler writes from the signal handler; give it a moment

    def _after_failure(self, starting: bool) -> None:
        if starting:
            self.close()
        else:
            self.restart()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        for inbox in self._inboxes:
            inbox.put(pickle.dumps((fn, args, kwargs)))
        return self._collect()

    def restart(self) -> None:
        self.close()
        self._start()

    def close(self) -> None:
        for inbox in getattr(self, "_inboxes", []):
            try:
                inbox.put(None)
            except Exception:
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        self._procs = []
