"""A GPT-style workload trained the way popular single-file GPT scripts train.

The model follows the common single-file GPT layout (token and position embeddings, pre-norm
blocks of causal self-attention and a 4x GELU MLP, LayerNorm without bias, an output head tied to
the token embedding, residual projections initialised by depth). The data are characters of English
prose (Python's bundled reference documentation, ``pydoc_data.topics``) with a vocabulary of the
characters that occur, as character-level GPT examples have it.

What makes it a workload of its own is its loop (:data:`LOOP`), the patterns such scripts use:
AdamW with two param groups (weight decay on matrices only), ``betas=(0.9, 0.95)``, the learning
rate set by hand in ``param_groups`` every iteration (linear warm-up, cosine decay to a tenth),
gradient accumulation over micro-batches (``require_backward_grad_sync`` off on all but the last),
``GradScaler.unscale_`` then ``clip_grad_norm_(model.parameters(), 1.0)``.
"""
from __future__ import annotations

import math
from typing import Dict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from experiments.objectives import NextTokenWindows, _rng
from experiments.workloads import EVAL_SEED, decoder_logits, prose_corpus

__all__ = ["GPT", "GPTConfig", "PromptGPT", "LOOP"]

#: The training-loop patterns of the workload (see :class:`experiments.loop.Loop`).
LOOP = {"manual_lr": True, "clip": 1.0, "accumulation": 2, "decay_groups": True, "weight_decay": 0.1,
        "betas": (0.9, 0.95)}


class GPTConfig:
    """Shape of the model: ~0.6M parameters by default."""

    def __init__(self, vocab: int, context: int = 64, layers: int = 3, heads: int = 4, width: int = 128):
        self.vocab, self.context, self.layers, self.heads, self.width = vocab, context, layers, heads, width

    def as_dict(self) -> Dict[str, int]:
        return dict(vars(self))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.heads = config.heads
        self.c_attn = nn.Linear(config.width, 3 * config.width, bias=False)
        self.c_proj = nn.Linear(config.width, config.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(batch, length, width))


class GPTBlock(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.width, bias=False)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.width, bias=False)
        self.c_fc = nn.Linear(config.width, 4 * config.width, bias=False)
        self.c_proj = nn.Linear(4 * config.width, config.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    """``[B, T]`` int64 tokens -> ``[B, T, vocab]`` logits."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab, config.width)
        self.wpe = nn.Embedding(config.context, config.width)
        self.h = nn.ModuleList(GPTBlock(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.width, bias=False)
        self.lm_head = nn.Linear(config.width, config.vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        for name, param in self.named_parameters():
            if param.dim() >= 2:
                std = 0.02 / math.sqrt(2 * config.layers) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(param, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return decoder_logits(tokens, self.wte, self.wpe, self.h, self.ln_f, self.lm_head)


class PromptGPT(NextTokenWindows):
    """Next-character prediction on English prose with :class:`GPT`.

    Batches are ``batch_size`` windows at offsets drawn from ``(seed, rank, step)``; the held-out
    loss is the mean cross-entropy (nats per character) over fixed held-out windows.
    """

    name = "gpt"
    default_batch_size = 16

    def __init__(self, seed: int = 0, eval_windows: int = 256, context: int = 64):
        self.seed, self.context = seed, context
        train, held, self.corpus_info = prose_corpus()
        chars = np.unique(np.concatenate([train, held]))
        lookup = np.zeros(256, dtype=np.int64)
        lookup[chars] = np.arange(chars.size)
        self.train, self.held_out = lookup[train], lookup[held]
        self.config = GPTConfig(vocab=int(chars.size), context=context)
        self.eval_offsets = _rng(EVAL_SEED).integers(0, self.held_out.size - context - 1, size=eval_windows)

    def describe(self) -> dict:
        return {"workload": self.name, "model": self.config.as_dict(), "corpus": self.corpus_info}

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return GPT(self.config)
