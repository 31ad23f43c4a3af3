"""The code that plants each float8 bug of :mod:`.float8_catalogue` in the tiny model.

The model's linear layers are torchao ``Float8Linear`` s (``Settings.float8``); each plant puts in
what the public thread found: a feature or a token far larger than the rest of a layer's input, a
zero-initialized layer cast with no floor on its amax, a loss term that makes a few grads far
larger than the rest.
"""

from __future__ import annotations

import torch

from .tiny_lm import TinyLM
from .training import Context, Plant

__all__ = ["GradOutlier", "OutlierFeature", "OutlierToken", "ZeroLayer"]


class OutlierFeature(Plant):
    """Feature ``feature`` of every token's embedding set to ``value`` before sharding: an input
    feature far larger than the others (a raw, unnormalized value concatenated into the
    embedding), in every row of block 0's fc1 input."""

    def __init__(self, feature: int, value: float) -> None:
        self.feature = feature
        self.value = value

    def before_shard(self, ctx: Context, model: TinyLM) -> None:
        with torch.no_grad():
            model.embed.weight[:, self.feature] = self.value


class OutlierToken(Plant):
    """The embedding output of each sequence's first token multiplied by ``gain`` (a massive
    activation on the first token, as attention sinks make): one row of block 0's fc1 input far
    larger than the others."""

    def __init__(self, gain: float) -> None:
        self.gain = gain

    def before_shard(self, ctx: Context, model: TinyLM) -> None:
        model.first_token_gain = self.gain


class ZeroLayer(Plant):
    """``module``'s weight (and bias) zeroed before sharding (a zero-initialized layer: LoRA's B,
    an adaLN-zero projection), cast by torchao with its amax floor (``EPS``) set to
    ``floor`` for the run (0: no floor, as the unfixed configuration had)."""

    def __init__(self, module: str, floor: float | None) -> None:
        self.module = module
        self.floor = floor
        self._saved: float | None = None

    def before_shard(self, ctx: Context, model: TinyLM) -> None:
        layer = model.get_submodule(self.module)
        with torch.no_grad():
            layer.weight.zero_()
            if getattr(layer, "bias", None) is not None:
                layer.bias.zero_()
        if self.floor is not None:
            from torchao.float8 import float8_utils

            self._saved = float8_utils.EPS
            float8_utils.EPS = self.floor

    def undo(self) -> None:
        if self._saved is not None:
            from torchao.float8 import float8_utils

            float8_utils.EPS, self._saved = self._saved, None


class GradOutlier(Plant):
    """``weight`` times the first token's logits added to the loss: a loss term weighted far above
    the rest (an auxiliary loss on one position with a coefficient meant for a mean over
    tokens), so the grads of that token's row are far larger than every other row's."""

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self._logits: torch.Tensor | None = None

    def on_logits(self, ctx: Context, logits: torch.Tensor) -> torch.Tensor:
        self._logits = logits
        return logits

    def on_loss(self, ctx: Context, loss: torch.Tensor) -> torch.Tensor:
        assert self._logits is not None
        first = self._logits[:, 0].float()
        self._logits = None
        return loss + self.weight * torch.logsumexp(first, dim=-1).mean()
