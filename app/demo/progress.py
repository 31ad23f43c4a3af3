"""Training progress on rank 0: a bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

_BAR_WIDTH = 24
# Weight of the newest step time in the moving average behind throughput and ETA.
_SMOOTHING = 0.3
# In line mode, about this many lines per run (plus the first and last step).
_LINES_PER_RUN = 20


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def _rate(tokens_per_s: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:.1f}{unit}"
    return f"{tokens_per_s:.0f}"


class Progress:
    """Shows loss, tokens/s, step time and ETA after each step.

    Args:
        start_step: Steps already done (a resumed run starts after them).
        total_steps: The step the run ends at.
        tokens_per_step: Tokens trained per optimizer step, over all ranks.
        mode: ``bar`` (one line redrawn), ``lines``, ``none``, or ``auto``: a bar when
            ``stream`` is a terminal, lines otherwise.
        stream: Where to write; stdout by default.
    """

    def __init__(
        self, start_step: int, total_steps: int, tokens_per_step: int, mode: str = "auto", stream: TextIO | None = None
    ) -> None:
        self._stream = stream or sys.stdout
        if mode == "auto":
            mode = "bar" if self._stream.isatty() else "lines"
        self.mode = mode
        self._start_step = start_step
        self._total = total_steps
        self._tokens = tokens_per_step
        self._average: float | None = None
        self._begun = time.perf_counter()
        self._every = max(1, (total_steps - start_step) // _LINES_PER_RUN)
        self._bar_open = False

    def step(self, step: int, loss: float, lr: float, seconds: float) -> None:
        """Report one finished step that took ``seconds``."""
        # The first step pays for start-up (allocations, telemetry set-up): keep it out of the average.
        if step > self._start_step + 1 or self._total == self._start_step + 1:
            self._average = (
                seconds if self._average is None else (1 - _SMOOTHING) * self._average + _SMOOTHING * seconds
            )
        per_step = self._average or seconds
        eta = per_step * (self._total - step)
        text = (
            f"loss {loss:.4f}  lr {lr:.2e}  {_rate(self._tokens / per_step)} tok/s  "
            f"{per_step * 1e3:.0f} ms/step  ETA {_duration(eta)}"
        )
        if self.mode == "bar":
            done = (step - self._start_step) / max(1, self._total - self._start_step)
            filled = int(done * _BAR_WIDTH)
            bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
            self._stream.write(f"\rstep {step:>{len(str(self._total))}}/{self._total} [{bar}] {text}\x1b[K")
            self._bar_open = True
        elif self.mode == "lines" and (step in (self._start_step + 1, self._total) or step % self._every == 0):
            self._stream.write(f"step {step:>{len(str(self._total))}}/{self._total}  {text}\n")
        self._stream.flush()

    def note(self, message: str) -> None:
        """A line of its own (a checkpoint saved), without breaking the bar."""
        if self.mode == "none":
            return
        if self._bar_open:
            self._stream.write("\n")
            self._bar_open = False
        self._stream.write(message + "\n")
        self._stream.flush()

    def close(self) -> float:
        """End the bar's line; returns the seconds since this object was made."""
        if self._bar_open:
            self._stream.write("\n")
            self._stream.flush()
            self._bar_open = False
        return time.perf_counter() - self._begun
