"""Training workloads that need no download: a character-level transformer language model
on the Python standard library's own source, and a small CNN on scikit-learn's digits.

A workload builds its model (identically on every rank, from the seed), hands each rank
its own training batch for each step, and evaluates held-out data. Batches are a pure
function of ``(seed, rank, step)``, so a run is reproducible and ranks never share a
batch.

Example::

    >>> workload = build_workload("charlm", seed=0, small=True)
    >>> model = workload.build_model()
    >>> x, y = workload.batch(rank=0, step=0, batch_size=16)
    >>> loss = workload.loss(model, x, y)
"""
from __future__ import annotations

import hashlib
import math
import pathlib
import sysconfig
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from experiments.objectives import HeldOutClassifier, NextTokenWindows, _rng

WORKLOADS = ("charlm", "proselm", "digits")

# Every 20th file of the corpus (in sorted order) is held out: splitting by file keeps
# near-duplicate neighbouring text out of the evaluation set.
HELD_OUT_EVERY = 20
# Fixed seeds for things that must not change with --seed: the evaluation windows and
# the digits train/test split.
EVAL_SEED = 1234
SPLIT_SEED = 0


# ---------------------------------------------------------------------------------------
# Character-level language model on the standard library's source.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CharLMConfig:
    """Shape of the character transformer. The default is ~10.8M parameters."""

    d_model: int = 384
    layers: int = 6
    heads: int = 6
    context: int = 64
    vocab: int = 256  # bytes are the tokens

    def __post_init__(self):
        if self.d_model % self.heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by heads={self.heads}")
        for name in ("d_model", "layers", "heads", "context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


CHARLM_PRESETS = {
    "default": CharLMConfig(),
    # For convergence runs and tests: ~0.4M parameters, tens of milliseconds a step.
    "small": CharLMConfig(d_model=128, layers=2, heads=4, context=64),
}


def stdlib_corpus() -> Tuple[np.ndarray, np.ndarray, Dict[str, object]]:
    """The standard library's ``.py`` files as bytes: ``(train, held_out, info)``.

    Files are read in sorted order of their path relative to the stdlib directory,
    skipping ``site-packages``/``dist-packages`` (installed packages vary by machine).
    Every :data:`HELD_OUT_EVERY`-th file goes to the held-out split. Both splits are
    uint8 arrays of the files joined by a NUL byte. ``info`` names the directory, file
    count, sizes and a SHA-256 of the whole corpus, so logs say exactly what was read
    (it differs between Python versions).
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (
            p
            for p in root.rglob("*.py")
            if p.is_file() and not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
        ),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not files:
        raise RuntimeError(f"no .py files found under the standard library directory {root}")
    train_parts: List[bytes] = []
    held_parts: List[bytes] = []
    digest = hashlib.sha256()
    for index, path in enumerate(files):
        data = path.read_bytes()
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + data)
        (held_parts if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train_parts).append(data)
    train = np.frombuffer(b"\0".join(train_parts), dtype=np.uint8)
    held = np.frombuffer(b"\0".join(held_parts), dtype=np.uint8)
    info = {
        "stdlib": str(root),
        "files": len(files),
        "train_bytes": int(train.size),
        "held_out_bytes": int(held.size),
        "sha256": digest.hexdigest()[:16],
    }
    return train, held, info


def decoder_logits(tokens: torch.Tensor, token_embedding: nn.Embedding, position_embedding: nn.Embedding,
                   blocks: nn.ModuleList, final_norm: nn.Module, head: nn.Linear) -> torch.Tensor:
    """The forward of a GPT-style decoder: ``[B, T]`` int64 tokens -> ``[B, T, vocab]`` logits (the
    token and position embeddings summed, the blocks in turn, the final norm, the output head).
    Shared by :class:`CharTransformer` and :class:`experiments.gpt.GPT`, which name their parts apart
    (their checkpoints' keys)."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    x = token_embedding(tokens) + position_embedding(positions)
    for block in blocks:
        x = block(x)
    return head(final_norm(x))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CharTransformer(nn.Module):
    """GPT-style byte-level LM: ``[B, T]`` int64 tokens -> ``[B, T, 256]`` logits.

    The output projection is tied to the token embedding (as in GPT-2).
    """

    def __init__(self, config: CharLMConfig):
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab, config.d_model)
        self.pos = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(Block(config.d_model, config.heads) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab, bias=False)
        self.head.weight = self.tok.weight
        self.apply(self._init)
        # GPT-2: scale the residual projections by depth so the residual stream stays O(1).
        for block in self.blocks:
            for proj in (block.proj, block.fc2):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * config.layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return decoder_logits(tokens, self.tok, self.pos, self.blocks, self.ln_f, self.head)


class CharLM(NextTokenWindows):
    """Next-byte prediction on the standard library's source (see :func:`stdlib_corpus`).

    A training batch is ``batch_size`` windows at offsets drawn from ``(seed, rank, step)``;
    the held-out loss is the mean cross-entropy (nats per byte) over ``eval_windows``
    fixed windows of the held-out files.
    """

    name = "charlm"
    default_lr = 1e-3
    default_batch_size = 16

    def __init__(self, config: CharLMConfig, seed: int = 0, eval_windows: int = 64):
        self.config = config
        self.seed = seed
        self.train, self.held_out, self.corpus_info = stdlib_corpus()
        span = config.context + 1
        self.eval_offsets = _rng(EVAL_SEED).integers(0, self.held_out.size - span, size=eval_windows)

    def describe(self) -> dict:
        return {"workload": self.name, "model": asdict(self.config), "corpus": self.corpus_info}

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return CharTransformer(self.config)

    @property
    def context(self) -> int:
        return self.config.context


# ---------------------------------------------------------------------------------------
# A second language model, of another architecture on another corpus: a recurrent (GRU)
# byte-level model of English prose, so that the recipes are judged on a model they were not
# written against.
# ---------------------------------------------------------------------------------------


PROSE_HELD_OUT_EVERY = 8


def prose_corpus() -> Tuple[np.ndarray, np.ndarray, Dict[str, object]]:
    """Python's bundled reference documentation (``pydoc_data.topics``, English prose) as bytes:
    ``(train, held_out, info)``; every :data:`PROSE_HELD_OUT_EVERY`-th topic (sorted by name) is held
    out (the topics are few and long, so the held-out share is larger than the stdlib corpus's)."""
    from pydoc_data import topics

    names = sorted(topics.topics)
    digest = hashlib.sha256()
    train_parts: List[bytes] = []
    held_parts: List[bytes] = []
    for index, name in enumerate(names):
        data = topics.topics[name].encode("utf-8")
        digest.update(name.encode() + b"\0" + data)
        (held_parts if index % PROSE_HELD_OUT_EVERY == PROSE_HELD_OUT_EVERY - 1 else train_parts).append(data)
    train = np.frombuffer(b"\0".join(train_parts), dtype=np.uint8)
    held = np.frombuffer(b"\0".join(held_parts), dtype=np.uint8)
    info = {"corpus": "pydoc_data.topics", "topics": len(names), "train_bytes": int(train.size),
            "held_out_bytes": int(held.size), "sha256": digest.hexdigest()[:16]}
    return train, held, info


class CharGRU(nn.Module):
    """Byte-level recurrent LM: ``[B, T]`` int64 tokens -> ``[B, T, 256]`` logits (embedding, a
    2-layer GRU, a linear head)."""

    def __init__(self, hidden: int = 192, layers: int = 2, vocab: int = 256):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.rnn = nn.GRU(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.tok(tokens))
        return self.head(out)


class ProseLM(CharLM):
    """Next-byte prediction on English prose with :class:`CharGRU` (~0.5M parameters); batches and
    evaluation as :class:`CharLM`."""

    name = "proselm"
    default_lr = 2e-3
    default_batch_size = 16

    def __init__(self, seed: int = 0, eval_windows: int = 64, hidden: int = 192, context: int = 64):
        self.config = CharLMConfig(d_model=hidden, layers=2, heads=1, context=context)
        self.seed = seed
        self.train, self.held_out, self.corpus_info = prose_corpus()
        span = context + 1
        self.eval_offsets = _rng(EVAL_SEED).integers(0, self.held_out.size - span, size=eval_windows)

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return CharGRU(self.config.d_model, self.config.layers)


# ---------------------------------------------------------------------------------------
# Small CNN on scikit-learn's bundled 8x8 digits.
# ---------------------------------------------------------------------------------------


class DigitsCNN(nn.Module):
    """``[B, 1, 8, 8]`` float -> ``[B, 10]`` logits; ~0.15M parameters."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class Digits(HeldOutClassifier):
    """Classification of scikit-learn's digits (1797 images, bundled, no download).

    Fixed split: 25% held out, stratified, ``random_state=0``. Pixels are scaled to [0, 1].
    """

    name = "digits"
    default_lr = 1e-3
    default_batch_size = 32

    def __init__(self, seed: int = 0):
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        self.seed = seed
        data = load_digits()
        images = (data.images / 16.0).astype(np.float32)[:, None]
        x_train, x_test, y_train, y_test = train_test_split(
            images, data.target, test_size=0.25, random_state=SPLIT_SEED, stratify=data.target
        )
        self.x_train, self.y_train = torch.from_numpy(x_train), torch.from_numpy(y_train).long()
        self.x_test, self.y_test = torch.from_numpy(x_test), torch.from_numpy(y_test).long()

    def describe(self) -> dict:
        return {"workload": self.name, "model": "DigitsCNN", "train": len(self.y_train), "test": len(self.y_test)}

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return DigitsCNN()

    def batch(self, rank: int, step: int, batch_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``: float ``[batch_size, 1, 8, 8]`` images and int64 labels."""
        index = torch.from_numpy(_rng(self.seed, rank, step).integers(0, len(self.y_train), size=batch_size))
        return self.x_train[index], self.y_train[index]


def build_workload(
    name: str,
    seed: int = 0,
    small: bool = False,
    charlm_overrides: Optional[dict] = None,
    eval_windows: int = 64,
):
    """A workload by name: ``"charlm"`` (``small`` picks the small preset; ``charlm_overrides``
    may set ``d_model``/``layers``/``heads``/``context``) or ``"digits"``."""
    if name == "charlm":
        config = CHARLM_PRESETS["small" if small else "default"]
        overrides = {k: v for k, v in (charlm_overrides or {}).items() if v is not None}
        if overrides:
            config = CharLMConfig(**{**asdict(config), **overrides})
        return CharLM(config, seed=seed, eval_windows=eval_windows)
    if name == "proselm":
        return ProseLM(seed=seed, eval_windows=eval_windows)
    if name == "digits":
        return Digits(seed=seed)
    raise ValueError(f"unknown workload {name!r}; choose one of {WORKLOADS}")
