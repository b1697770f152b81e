"""What the live level costs a frozen optimizer step: ``FrozenVarianceAdam.before_optimizer_step`` on
charlm-small's parameters (the main job's model, 28 tensors), the spike guard on, with and without the level,
one thread.

Usage, from the repository root (through ``../shared/tools/quiet``):
``PYTHONPATH=. python experiments/results/research-live-scale/bench_level.py [ROUNDS]``. Prints the medians of
interleaved rounds (each the median of 20 calls) and their ratio.
"""
import statistics
import sys
import time

import torch

from experiments.workloads import build_workload
from gradcomp.optim import FrozenVarianceAdam


def stage_and_model(level: bool):
    torch.manual_seed(0)
    model = build_workload("charlm", small=True).build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stage = FrozenVarianceAdam(optimizer, model.named_parameters(), freeze_step=10, live_level=level)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    for _ in range(12):  # past the freeze and the guard's warm-up
        optimizer.step()
    return stage, model


def timed(stage, model, calls: int = 20) -> float:
    grads = [p.grad for p in model.parameters()]
    times = []
    for _ in range(calls):
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        start = time.perf_counter()
        stage.before_optimizer_step()
        times.append(time.perf_counter() - start)
        stage.after_optimizer_step()
    return statistics.median(times)


if __name__ == "__main__":
    torch.set_num_threads(1)
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    runs = {level: stage_and_model(level) for level in (False, True)}
    print("elements:", sum(p.numel() for p in runs[True][1].parameters()))
    samples = {False: [], True: []}
    for _ in range(rounds):
        for level in (False, True):
            samples[level].append(timed(*runs[level]))
    off, on = statistics.median(samples[False]), statistics.median(samples[True])
    print(f"frozen step without the level {off * 1e3:.3f} ms, with it {on * 1e3:.3f} ms: "
          f"+{(on - off) * 1e3:.3f} ms ({on / off:.3f}x), medians of {rounds} interleaved rounds of 20 calls")
