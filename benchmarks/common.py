"""What every benchmark case shares: clocks, paired measurement, rows of the table, a process group.

Measurement discipline (the machine may be shared and small): contenders run side by side in
one process, alternating within each round in a rotating order, so that drift of the machine
hits them alike; a ratio is the median of the per-round ratios, a time the median of its
samples. On CUDA every duration is a pair of CUDA events read after a synchronize.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "CaseResult",
    "Clock",
    "Row",
    "device_name",
    "device_slug",
    "write_results",
    "median",
    "paired",
    "paired_ratio",
    "process_group",
    "training_steps",
]


class Clock:
    """Times a stretch of code: CUDA events on a CUDA device (read after a synchronize), else perf_counter."""

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"

    def start(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds_since(self, token: Any) -> float:
        if not self.cuda:
            return time.perf_counter() - token
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return token.elapsed_time(end) / 1000.0

    def time(self, fn: Callable[[], Any]) -> float:
        """Seconds ``fn()`` takes."""
        token = self.start()
        fn()
        return self.seconds_since(token)


def paired(contenders: dict[str, Callable[[], float]], rounds: int, warmup: int = 2) -> dict[str, list[float]]:
    """Runs every contender once per round, in an order that rotates from round to round.

    Args:
        contenders: Name -> function returning the seconds of one measured run.
        rounds: Measured rounds.
        warmup: Unrecorded rounds first.

    Returns:
        Name -> its ``rounds`` durations, in round order (index ``i`` of two lists are neighbours).
    """
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(warmup + rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            seconds = contenders[name]()
            if index >= warmup:
                times[name].append(seconds)
    return times


def training_steps(
    built: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]],
    batches: list[torch.Tensor],
    clock: Clock,
    loss: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    clip: float | None = None,
) -> Callable[[str], float]:
    """``step(name)``: one timed training step (forward, backward, optimizer step, zero_grad) of
    model ``name`` of ``built`` on its next batch; each model walks ``batches`` on its own. With
    ``clip``, the grads are clipped to that total norm before the step (``clip_grad_norm_``, as
    most training scripts do)."""
    cursor = dict.fromkeys(built, 0)

    def step(name: str) -> float:
        model, optimizer = built[name]
        tokens = batches[cursor[name] % len(batches)]
        cursor[name] += 1
        start = clock.start()
        loss(model, tokens).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        return clock.seconds_since(start)

    return step


def median(values: list[float]) -> float:
    return statistics.median(values)


def adapt_in_environment(optimizer: torch.optim.Optimizer, values: dict[str, str]) -> None:
    """``fully_shard_optimizer(optimizer)`` with the telemetry settings ``values`` (and no other
    ``FSDP_PATCH_TELEMETRY`` or ``FSDP_PATCH_PRECISION_*`` of the caller's): models adapted side by
    side each get their own, read once, at adaptation."""
    from unittest import mock

    from fsdp_patch.optimizer import fully_shard_optimizer

    environment = {key: value for key, value in os.environ.items() if not key.startswith("FSDP_PATCH_PRECISION_")}
    environment.pop("FSDP_PATCH_TELEMETRY", None)
    with mock.patch.dict(os.environ, {**environment, **values}, clear=True):
        fully_shard_optimizer(optimizer)


def paired_ratio(times: dict[Any, list[float]], numerator: Any, denominator: Any) -> float:
    """Median over rounds of ``numerator / denominator``: drift of the machine cancels out."""
    return statistics.median(a / b for a, b in zip(times[numerator], times[denominator], strict=True))


@dataclass
class Row:
    """One line of the suite's table.

    Attributes:
        case: The case's number and name (``"2 step"``).
        measure: What is compared or measured.
        value: The figure.
        unit: ``"x"`` for a ratio, else the unit of ``value``.
        target: The target as text (``"<= 1.3"``), or ``""`` where the case sets none.
        met: Whether the target is met; ``None`` without a target.
        note: Context (absolute times, sizes).
    """

    case: str
    measure: str
    value: float
    unit: str = "x"
    target: str = ""
    met: bool | None = None
    note: str = ""


def target_row(
    case: str,
    measure: str,
    value: float,
    *,
    at_most: float | None = None,
    at_least: float | None = None,
    unit: str = "x",
    note: str = "",
) -> Row:
    """A row whose target is an upper (``at_most``) or lower (``at_least``) bound."""
    if at_most is not None:
        return Row(case, measure, value, unit, f"<= {at_most:g}", value <= at_most, note)
    if at_least is not None:
        return Row(case, measure, value, unit, f">= {at_least:g}", value >= at_least, note)
    return Row(case, measure, value, unit, "", None, note)


@dataclass
class CaseResult:
    """A case's rows for the table and its raw figures for the JSON file."""

    rows: list[Row] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"rows": [asdict(row) for row in self.rows], "raw": self.raw}


@contextlib.contextmanager
def process_group(device: str) -> Iterator[torch.device]:
    """A world-size-1 process group (gloo on the CPU, NCCL on CUDA) unless one exists; yields
    the device tensors go on."""
    cuda = device == "cuda"
    if dist.is_initialized():
        yield torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        return
    with tempfile.TemporaryDirectory() as tmp:
        if cuda:
            torch.cuda.set_device(0)
        dist.init_process_group(
            "nccl" if cuda else "gloo", init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=0, world_size=1
        )
        try:
            yield torch.device("cuda", 0) if cuda else torch.device("cpu")
        finally:
            dist.destroy_process_group()


def device_name(device: str) -> str:
    """The GPU's name on CUDA (``NVIDIA H200``), else the CPU's architecture and core count."""
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"cpu-{platform.machine()}-{os.cpu_count()}cores"


def device_slug(device: str) -> str:
    """``device_name`` as a file-name part: ``nvidia-h200``, ``cpu-x86_64-2cores``."""
    return re.sub(r"[^a-z0-9_]+", "-", device_name(device).lower()).strip("-")


def write_results(
    json_path: str, benchmark: str, results: dict[str, Any], world_size: int | None = None, device: str | None = None
) -> None:
    """Write one benchmark's figures as JSON, with the device, world, torch and timer they came from.

    On a rank the device and world are the process group's; outside the ranks (figures gathered
    from several jobs, or after the group is gone) ``world_size`` names the world and ``device``
    the device (``"cuda"`` or ``"cpu"``, the default).
    """
    import json

    cuda = device == "cuda" if device is not None else world_size is None and dist.get_backend() == "nccl"
    document = {
        "benchmark": benchmark,
        "device": device_name("cuda" if cuda else "cpu"),
        "world_size": dist.get_world_size() if world_size is None else world_size,
        "torch": torch.__version__,
        "timer": "cuda_events" if cuda else "perf_counter",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **results,
    }
    os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=1)
        f.write("\n")
    print(f"wrote {json_path}")


def write_rank_result(out_dir: str, result: dict[str, Any]) -> None:
    """This rank's figures as ``out_dir/rank{R}.json``, which the case's ``run`` gathers."""
    import json
    import os

    import torch.distributed as dist

    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
