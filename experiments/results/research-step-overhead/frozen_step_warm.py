"""Warm, one thread: the Adam stage's frozen-variance step of charlm-small's parameters under AdamW (the factor of the
spike guard and the live level, the moments' lerp, the decay, the addcdiv), as torch's multi-tensor ops take it
against the one pass of ``gradcomp/backends/numba/frozen_step.py``, interleaved, each on its own copy of the same
tensors; medians of ``REPEATS`` steps each, and that both copies hold the same bits after them. Informal (no link, no
ranks). From the repository root::

    PYTHONPATH=. python experiments/results/research-step-overhead/frozen_step_warm.py [REPEATS]
"""
import statistics
import sys
import time

import numba
import torch

from experiments import suite
from gradcomp.backends import form_kernel
from gradcomp.backends.numba import frozen_step


def main(repeats: int) -> None:
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    shapes = [p.shape for p in suite.build("charlm-small", 0, 32).build_model().parameters()]
    params = [torch.randn(shape, generator=generator) for shape in shapes]
    moments = [torch.randn(shape, generator=generator) * 1e-3 for shape in shapes]
    grads = [torch.randn(shape, generator=generator) * 1e-3 for shape in shapes]
    denoms = [torch.rand(shape, generator=generator) * 1e-3 + 1e-8 for shape in shapes]
    copies = {"torch": ([p.clone() for p in params], [m.clone() for m in moments]), "one pass": (params, moments)}
    factor, weight, decay = torch.tensor(0.93), 0.1, 1 - 3e-4 * 0.1
    values = [-3e-4 / (1 - 0.9 ** 300)] * len(params)
    fused = form_kernel("elementwise", "frozen_step", params[0].device, "numba")
    steps = {
        "torch": lambda: frozen_step._torch_form(*copies["torch"], grads, denoms, factor, weight, False, decay, values),
        "one pass": lambda: fused(*copies["one pass"], grads, denoms, factor, weight, False, decay, values),
    }
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    pairs = [(a, b) for mine, theirs in zip(copies["one pass"], copies["torch"]) for a, b in zip(mine, theirs)]
    same = all(torch.equal(a, b) for a, b in pairs)
    print(f"{len(params)} tensors, {sum(p.numel() for p in params):,} elements, "
          f"the same bits after {repeats} steps: {same}")
    for name, seconds in times.items():
        print(f"{name:>9}: {statistics.median(seconds) * 1e3:.3f} ms (median of {repeats})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 400)
