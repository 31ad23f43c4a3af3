"""The demo's learning-rate schedule: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math


class WarmupCosine:
    """Multiplier of the peak learning rate at a step, for ``torch.optim.lr_scheduler.LambdaLR``.

    Rises linearly over ``warmup_steps`` (from ``1 / warmup_steps``), then follows a cosine from
    1 down to ``min_ratio`` at step ``decay_steps``, and stays there. A callable object rather
    than a function, so that ``LambdaLR.state_dict()`` saves its settings with the checkpoint.

    Args:
        warmup_steps: Steps of linear warm-up (0: none).
        decay_steps: Step at which the decay reaches ``min_ratio``.
        min_ratio: Final multiplier, ``min_lr / lr``.
    """

    def __init__(self, warmup_steps: int, decay_steps: int, min_ratio: float) -> None:
        self.warmup_steps = warmup_steps
        self.decay_steps = decay_steps
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        # LambdaLR calls with the number of scheduler steps taken so far: 0 for the first optimizer step.
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.decay_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
