"""Warm, one thread: charlm-small's 3-bit group compressed (Adam's divisor, the residual in place) part by part, one
parallel kernel call a part as the batched op ran before, against the batched op as it is (every part in one call
over the group's table of work units, ``gradcomp/backends/numba/group_parts.py``), interleaved; medians of
``REPEATS`` calls each, and that both wrote the same bits. Informal (no link, no ranks). From the repository root::

    PYTHONPATH=. python experiments/results/research-step-overhead/compress_warm.py [REPEATS]
"""
import statistics
import sys
import time

import numba
import numpy as np
import torch

from experiments import suite
from gradcomp.backends import kernel_parts
from gradcomp.backends.numba import threebit
from gradcomp.backends.parts import spans
from gradcomp.compressors import ThreeBit
from gradcomp.compressors.per_parameter import PerParameter


def main(repeats: int) -> None:
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    numels = [p.numel() for p in suite.build("charlm-small", 0, 32).build_model().parameters()]
    group, n = PerParameter(ThreeBit(), numels, 1024), sum(numels)
    plan = group._plan(torch.float32)
    generator = torch.Generator().manual_seed(0)
    grad, start = torch.randn(n, generator=generator), torch.randn(n, generator=generator) * 0.01
    divisor = torch.rand(n, generator=generator) + 0.5
    words = plan.whole.nbytes // 4
    one_call = kernel_parts("threebit_compress", grad.device, "numba")

    def part_by_part(residual, out):
        w = out.numpy().view(np.uint32)
        g, r, d = grad.numpy(), residual.numpy(), divisor.numpy()
        for part in plan.batched:
            codes, scales = spans("threebit_compress", part)
            piece = slice(part.lo, part.lo + part.numel)
            threebit.compress_kernel(g[piece], r[piece], True, w[codes], w.view(np.float32)[scales], d[piece])

    timed = {"part by part": part_by_part,
             "one call": lambda residual, out: one_call(grad, residual, residual, out, plan.batched, divisor=divisor)}
    written = {}
    for name, call in timed.items():
        residual, out = start.clone(), torch.zeros(words, dtype=torch.int32)
        call(residual, out)
        written[name] = (residual, out)
    same = all(torch.equal(a, b) for a, b in zip(*written.values()))
    seconds = {name: [] for name in timed}
    residual, out = start.clone(), torch.zeros(words, dtype=torch.int32)
    for _ in range(repeats):
        for name, call in timed.items():
            residual.copy_(start)
            begin = time.perf_counter()
            call(residual, out)
            seconds[name].append(time.perf_counter() - begin)
    print(f"{len(numels)} parameters, {len(plan.batched)} 3-bit parts, {n} elements; medians of {repeats}; "
          f"the same bits: {same}")
    for name, values in seconds.items():
        print(f"{statistics.median(values[repeats // 10:]) * 1e3:7.3f} ms  {name}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 400)
