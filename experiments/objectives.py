"""What a workload computes from its model, written once for each kind of task: the training batches and
loss, the held-out sums and the metrics of a next-token model (:class:`NextTokenWindows`: the language
models of :mod:`experiments.workloads` and :mod:`experiments.gpt`) and of an image classifier
(:class:`HeldOutClassifier`: the digits and the shapes of :mod:`experiments.images`).
"""
from __future__ import annotations

from typing import Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["NextTokenWindows", "HeldOutClassifier"]


def _rng(*words: int) -> np.random.Generator:
    """A generator seeded by a tuple of integers (NumPy's SeedSequence mixes them)."""
    return np.random.default_rng([int(w) for w in words])


class NextTokenWindows:
    """Batches, loss and held-out sums of a next-token model on a token array: ``train`` and
    ``held_out`` (int arrays), ``context``, ``seed`` and ``eval_offsets`` are the workload's."""

    def _windows(self, data: np.ndarray, offsets: np.ndarray) -> Tuple[torch.Tensor, torch.Tensor]:
        span = self.context + 1
        windows = np.stack([data[o : o + span] for o in offsets]).astype(np.int64)
        windows = torch.from_numpy(windows)
        return windows[:, :-1], windows[:, 1:]

    def batch(self, rank: int, step: int, batch_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``: int64 ``[batch_size, context]`` inputs and next-token targets."""
        offsets = _rng(self.seed, rank, step).integers(0, self.train.size - self.context - 1, size=batch_size)
        return self._windows(self.train, offsets)

    @staticmethod
    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    @torch.no_grad()
    def evaluate_sums(self, model: nn.Module, shard: int, shards: int, device, batch_size: int = 32) -> torch.Tensor:
        """``[loss sum, token count, 0]`` over this shard of the held-out windows
        (float64, on ``device``); sum the shards of all ranks, then divide."""
        offsets = self.eval_offsets[shard::shards]
        total = torch.zeros(3, dtype=torch.float64, device=device)
        for start in range(0, len(offsets), batch_size):
            x, y = self._windows(self.held_out, offsets[start : start + batch_size])
            x, y = x.to(device), y.to(device)
            logits = model(x)
            total[0] += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").double()
            total[1] += y.numel()
        return total

    @staticmethod
    def metrics(sums: torch.Tensor) -> dict:
        return {"eval_loss": float(sums[0] / sums[1])}


class HeldOutClassifier:
    """Loss, held-out sums and metrics of an image classifier whose held-out set is ``x_test``, ``y_test``."""

    @staticmethod
    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate_sums(self, model: nn.Module, shard: int, shards: int, device, batch_size: int = 256) -> torch.Tensor:
        """``[loss sum, count, correct]`` over this shard of the held-out set (float64)."""
        x_all, y_all = self.x_test[shard::shards], self.y_test[shard::shards]
        total = torch.zeros(3, dtype=torch.float64, device=device)
        for start in range(0, len(y_all), batch_size):
            x, y = x_all[start : start + batch_size].to(device), y_all[start : start + batch_size].to(device)
            logits = model(x)
            total[0] += F.cross_entropy(logits, y, reduction="sum").double()
            total[1] += y.numel()
            total[2] += (logits.argmax(1) == y).sum().double()
        return total

    @staticmethod
    def metrics(sums: torch.Tensor) -> dict:
        return {"eval_loss": float(sums[0] / sums[1]), "accuracy": float(sums[2] / sums[1])}
