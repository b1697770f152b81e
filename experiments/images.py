"""Image workloads that need no download: an MLP on scikit-learn's digits, and a small CNN on
procedurally drawn shapes.

* ``digits-mlp``: the 8x8 digits (1797 images, bundled with scikit-learn) flattened into a
  two-hidden-layer MLP; the fixed split of :class:`experiments.workloads.Digits`.
* ``shapes``: 24x24 grayscale images of ten shapes (disc, ring, square, frame, triangle, cross,
  plus, bars, diagonal, dots) at random positions, sizes and intensities, with noise; every
  training batch is drawn afresh from ``(seed, rank, step)``, the held-out set is fixed. A
  three-layer CNN classifies them.

Both have the interface of the other workloads (``build_model``, ``batch``, ``loss``,
``evaluate_sums``, ``metrics``, ``describe``, ``default_batch_size``).
"""
from __future__ import annotations

from typing import Tuple

import numpy as np
import torch
import torch.nn as nn

from experiments.objectives import HeldOutClassifier, _rng
from experiments.workloads import EVAL_SEED, Digits

__all__ = ["DigitsMLP", "Shapes", "SHAPES"]

SHAPES = ("disc", "ring", "square", "frame", "triangle", "cross", "plus", "bars", "diagonal", "dots")
SIDE = 24


class DigitsMLP(Digits):
    """scikit-learn's digits with a 64 -> 256 -> 256 -> 10 MLP (~85K parameters)."""

    name = "digits-mlp"

    def describe(self) -> dict:
        return {**super().describe(), "workload": self.name, "model": "MLP 64-256-256-10"}

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, 10))


def _draw(kind: int, rng: np.random.Generator) -> np.ndarray:
    """One ``[SIDE, SIDE]`` float32 image of shape ``kind`` at a random place, size and intensity."""
    y, x = np.mgrid[0:SIDE, 0:SIDE].astype(np.float32)
    cy, cx = rng.uniform(7, SIDE - 7, size=2)
    r = rng.uniform(3.5, 6.5)
    dy, dx = y - cy, x - cx
    dist = np.sqrt(dy**2 + dx**2)
    masks = {
        "disc": dist < r,
        "ring": (dist < r) & (dist > r - 1.6),
        "square": (np.abs(dy) < r) & (np.abs(dx) < r),
        "frame": (np.abs(dy) < r) & (np.abs(dx) < r) & ((np.abs(dy) > r - 1.6) | (np.abs(dx) > r - 1.6)),
        "triangle": (dy < r) & (dy > -r) & (np.abs(dx) < (dy + r) / 2),
        "cross": (np.abs(dy - dx) < 1.2) | (np.abs(dy + dx) < 1.2),
        "plus": ((np.abs(dy) < 1.2) & (np.abs(dx) < r)) | ((np.abs(dx) < 1.2) & (np.abs(dy) < r)),
        "bars": (np.abs(dx) < r) & (np.abs(dy) < r) & (np.floor((dy + r) / 2) % 2 == 0),
        "diagonal": (np.abs(dy - dx) < 1.5) & (dist < r + 2),
        "dots": ((dy % 5) < 1.5) & ((dx % 5) < 1.5) & (dist < r + 1),
    }
    image = masks[SHAPES[kind]].astype(np.float32) * rng.uniform(0.5, 1.0)
    return image + rng.normal(0, 0.15, size=image.shape).astype(np.float32)


def _batch(rng: np.random.Generator, size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    labels = rng.integers(0, len(SHAPES), size=size)
    images = np.stack([_draw(int(k), rng) for k in labels])[:, None]
    return torch.from_numpy(images), torch.from_numpy(labels).long()


class ShapesCNN(nn.Module):
    """``[B, 1, 24, 24]`` -> ``[B, 10]``: three 3x3 convolutions with pooling, then a linear head (~60K)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(64 * 3 * 3, len(SHAPES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class Shapes(HeldOutClassifier):
    """Ten procedurally drawn shapes; the held-out set is 1024 fixed images."""

    name = "shapes"
    default_batch_size = 32

    def __init__(self, seed: int = 0, held_out: int = 1024):
        self.seed = seed
        self.x_test, self.y_test = _batch(_rng(EVAL_SEED, 7), held_out)

    def describe(self) -> dict:
        return {"workload": self.name, "model": "ShapesCNN", "classes": list(SHAPES), "test": len(self.y_test)}

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return ShapesCNN()

    def batch(self, rank: int, step: int, batch_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``: float ``[batch_size, 1, 24, 24]`` images and int64 labels."""
        return _batch(_rng(self.seed, rank, step), batch_size)
