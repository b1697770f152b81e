"""The GPT loop with its clip in a phase of the recipe (``all``, ``dense``, ``frozen``, ``none``: ``screen_phase.py``'s
``dense``/``frozen``, or the loop's own clip everywhere or nowhere) and the frozen steps times SCALE
(``screen_step_scale.py``), logging what each frozen step steps on: per optimizer step of rank 0's replica, the root
mean square of its input in Adam's units ``rms(g / d)`` (SpikeGuard's ``r``, over every parameter) and that
input's norm ``|g|``, written as JSON lines to ``LOG.frozen``.

Usage, from the repository root:
PYTHONPATH=. python experiments/results/research-clip-phase/screen_log.py LOG WORKLOAD METHOD PHASE SCALE [SEED]
"""
import json
import sys

import torch

from experiments import screening  # one thread for every pool, before numba loads
from gradcomp.optim import frozen_adam

PHASE, SCALE = sys.argv[4], float(sys.argv[5])
FROZEN = [False]
GROUPS = {}  # id(param group) -> the order it was first seen in: rank 0's replica's groups come first
SUMS = {}  # (group's order, step) -> [sum of (g / d)^2, sum of g^2, elements]
_clip, _update = torch.nn.utils.clip_grad_norm_, frozen_adam.frozen_update


def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
    keep = PHASE == "all" or (PHASE == "dense" and not FROZEN[0]) or (PHASE == "frozen" and FROZEN[0])
    return _clip(parameters, max_norm if keep else float("inf"), *args, **kwargs)


def frozen_update(params, exp_avgs, grads, denoms, steps, group, decoupled, exchange, bounded):
    FROZEN[0] = True
    grads = [g * SCALE for g in grads]
    order = GROUPS.setdefault(id(group), len(GROUPS))
    SUMS[(order, steps[0])] = [sum(float((g.float() / d).square().sum()) for g, d in zip(grads, denoms)),
                               sum(float(g.float().square().sum()) for g in grads), sum(g.numel() for g in grads)]
    return _update(params, exp_avgs, grads, denoms, steps, group, decoupled, exchange, bounded)


def rows():
    """Per step, rank 0's replica (the first half of the groups seen): ``r`` and ``|g|`` over its groups."""
    steps = {}
    for (order, step), (sq, norm, n) in SUMS.items():
        if order < len(GROUPS) // 2:
            total = steps.setdefault(step, [0.0, 0.0, 0])
            total[0], total[1], total[2] = total[0] + sq, total[1] + norm, total[2] + n
    return [{"step": t, "r": (sq / n) ** 0.5, "norm": norm ** 0.5} for t, (sq, norm, n) in sorted(steps.items())]


if __name__ == "__main__":
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    frozen_adam.frozen_update = frozen_update
    screening.run_whole(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[6]) if len(sys.argv) > 6 else 0)
    with open(sys.argv[1] + ".frozen", "w") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows())
