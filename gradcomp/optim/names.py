"""Parameter names as the engine keys them: those of the module DDP wraps."""
from __future__ import annotations

from typing import Iterable, List, Tuple

import torch

__all__ = ["unwrapped"]

#: The prefix DDP's wrapper (and ``torch.compile``'s) adds to the names of the module it holds.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def unwrapped(named_parameters: Iterable[Tuple[str, torch.nn.Parameter]]) -> List[Tuple[str, torch.nn.Parameter]]:
    """``named_parameters`` with a wrapper's prefix removed where every name carries it, so that
    ``ddp_model.named_parameters()`` and ``ddp_model.module.named_parameters()`` give the same keys."""
    named = list(named_parameters)
    changed = True
    while changed and named:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if all(isinstance(name, str) and name.startswith(prefix) for name, _ in named):
                named = [(name[len(prefix):], p) for name, p in named]
                changed = True
    return named
