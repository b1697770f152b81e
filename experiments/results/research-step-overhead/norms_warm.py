"""Warm, one thread: the Adam stage's two statistics of a step's gradients over charlm-small's parameters, as torch's
multi-tensor ops take them (``_foreach_norm`` of ``_foreach_div(grads, denoms)`` for the spike guard, ``_foreach_norm``
of the gradients for the live level) against the one pass of ``gradcomp/backends/numba/norms.py``, interleaved;
medians of ``REPEATS`` calls each, and that both gave the same bits. Informal (no link, no ranks). From the repository
root::

    PYTHONPATH=. python experiments/results/research-step-overhead/norms_warm.py [REPEATS]
"""
import statistics
import sys
import time

import numba
import torch

from experiments import suite
from gradcomp.backends import form_kernel


def main(repeats: int) -> None:
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    shapes = [p.shape for p in suite.build("charlm-small", 0, 32).build_model().parameters()]
    grads = [torch.randn(shape, generator=generator) * 1e-3 for shape in shapes]
    denoms = [torch.rand(shape, generator=generator) * 1e-3 + 1e-8 for shape in shapes]
    fused = form_kernel("elementwise", "quotient_norms", grads[0].device, "numba")

    def torch_form():
        quotients = torch.stack(torch._foreach_norm(torch._foreach_div(grads, denoms)))
        return quotients, torch.stack(torch._foreach_norm(grads))

    got, expected = fused(grads, denoms), torch_form()
    same = all(torch.equal(a, b) for a, b in zip(got, expected))
    times = {"torch": [], "one pass": []}
    for _ in range(repeats):
        for name, run in (("torch", torch_form), ("one pass", lambda: fused(grads, denoms))):
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    print(f"{len(grads)} tensors, {sum(g.numel() for g in grads):,} elements, the same bits: {same}")
    for name, seconds in times.items():
        print(f"{name:>9}: {statistics.median(seconds) * 1e3:.3f} ms (median of {repeats})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 400)
