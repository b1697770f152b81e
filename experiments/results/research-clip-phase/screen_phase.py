"""The GPT loop's clip (``clip_grad_norm_(…, 1.0)``) in one phase of the recipe only: ``dense`` clips the dense start
(the variance then freezes on clipped gradients) and not the compressed steps; ``frozen`` clips only the compressed
steps (from the first step after the first frozen update). The clip's norm is still measured and returned in the
other phase. Which half of the clip gives 2-bit its gain?

Usage, from the repository root (WORKLOAD ``gpt``, the loop with its clip):
PYTHONPATH=. python experiments/results/research-clip-phase/screen_phase.py LOG WORKLOAD METHOD PHASE [SEED] [OPT]
"""
import sys

import torch

from experiments import screening  # one thread for every pool, before numba loads
from gradcomp.optim import frozen_adam

PHASE = sys.argv[4]
FROZEN = [False]
_clip, _update = torch.nn.utils.clip_grad_norm_, frozen_adam.frozen_update


def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
    if (PHASE == "dense") != FROZEN[0]:
        return _clip(parameters, max_norm, *args, **kwargs)
    return _clip(parameters, float("inf"), *args, **kwargs)  # measures the norm, scales by 1


def frozen_update(*args, **kwargs):
    FROZEN[0] = True
    return _update(*args, **kwargs)


if __name__ == "__main__":
    if PHASE not in ("dense", "frozen"):
        raise SystemExit(f"PHASE is dense or frozen, got {PHASE!r}")
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    frozen_adam.frozen_update = frozen_update
    screening.run_whole(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[5]) if len(sys.argv) > 5 else 0,
                        sys.argv[6] if len(sys.argv) > 6 else "adamw")
