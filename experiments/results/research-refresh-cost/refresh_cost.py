"""What a refresh of Adam's frozen variance costs next to the frozen step it precedes, on one CPU thread.

On the GPT workload's parameters (``experiments.gpt``, about 0.6M float32 in its AdamW groups), with synthetic
state: the frozen step (``gradcomp.optim.frozen_update.frozen_update``, the Numba one-pass form where it runs) and a
refresh (``variance_refresh._take`` with the first-moment sample, then ``adam_settings.frozen_denominators`` and the
group divisor's concatenation the next exchange rebuilds). Medians of interleaved repeats, milliseconds. Informal:
run from the repository root, ``PYTHONPATH=. python experiments/results/research-refresh-cost/refresh_cost.py``.
"""
import statistics
import time

import torch

from experiments.gpt import GPT, GPTConfig
from gradcomp.optim import variance_refresh
from gradcomp.optim.adam_settings import frozen_denominators
from gradcomp.optim.frozen_update import frozen_update

REPEATS = 60


def state(params):
    generator = torch.Generator().manual_seed(0)

    def like(scale):
        return [torch.randn(p.shape, generator=generator) * scale for p in params]

    exp_avgs, variances, grads = like(1e-3), [v.abs() for v in like(1e-6)], like(1e-3)
    for param, grad in zip(params, grads):
        param.grad = grad
    denoms = frozen_denominators(variances, 0.95, 100, 0.1, 1e-8)
    return exp_avgs, variances, grads, denoms


def main():
    torch.set_num_threads(1)
    params = [p.detach().requires_grad_(False) for p in GPT(GPTConfig(vocab=80)).parameters()]
    exp_avgs, variances, grads, denoms = state(params)
    group = {"betas": (0.9, 0.95), "lr": 1e-3, "weight_decay": 0.1, "eps": 1e-8}
    taken = [({"exp_avg_sq": v, "exp_avg": m}, p) for v, m, p in zip(variances, exp_avgs, params)]

    def step():
        frozen_update(params, exp_avgs, grads, denoms, [101] * len(params), group, True, "gradient", False)

    def refresh():
        variance_refresh._take(taken, [None] * len(taken), 0.95)
        fresh = frozen_denominators(variances, 0.95, 101, 0.1, 1e-8)
        torch.cat([d.reshape(-1) for d in fresh])

    times = {"step": [], "refresh": []}
    for _ in range(REPEATS):
        for name, fn in (("step", step), ("refresh", refresh)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    elements = sum(p.numel() for p in params)
    step_ms, refresh_ms = (1e3 * statistics.median(times[k][5:]) for k in ("step", "refresh"))
    print(f"{len(params)} tensors, {elements} elements, one thread: frozen step {step_ms:.2f} ms, "
          f"refresh {refresh_ms:.2f} ms ({refresh_ms / step_ms:.1f}x the step)")


if __name__ == "__main__":
    main()
