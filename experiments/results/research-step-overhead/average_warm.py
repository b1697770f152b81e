"""Warm, one thread: charlm-small's 3-bit group averaged over two ranks' payloads, rank by rank (zero, two decodes,
``divide_multiply``, the commit's ``aminmax`` check) against the one-call average (``PerParameter.average``: the
decodes and the dense parts' values summed in a scratch row, each element written once with its finite verdict), interleaved; medians of
``REPEATS`` calls each, and the one-call kernel alone. Informal (no link, no ranks). From the repository root::

    PYTHONPATH=. python experiments/results/research-step-overhead/average_warm.py [REPEATS]
"""
import statistics
import sys
import time

import numba
import numpy as np
import torch

from experiments import suite
from gradcomp.backends.numba import average, threebit
from gradcomp.compressors import ThreeBit
from gradcomp.compressors.per_parameter import PerParameter
from gradcomp.payload import Payload
from gradcomp.validation import all_finite


def main(repeats: int) -> None:
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    numels = [p.numel() for p in suite.build("charlm-small", 0, 32).build_model().parameters()]
    group, n = PerParameter(ThreeBit(), numels, 1024), sum(numels)
    multiplier = torch.rand(n, generator=torch.Generator().manual_seed(1)) + 0.5
    gathered = torch.cat([group.compress(torch.randn(n, generator=torch.Generator().manual_seed(rank)),
                                         backend="numba").buffer for rank in range(2)])
    layout, out = group._plan(torch.float32).whole, torch.empty(n)

    def rank_by_rank():
        out.zero_()
        for rank in range(2):
            group.decompress_add(Payload(layout, gathered[rank * layout.nbytes:(rank + 1) * layout.nbytes]), out,
                                 "numba")
        out.div_(2).mul_(multiplier)
        all_finite(out)

    words = gathered.view(torch.int32).view(2, -1).numpy().view(np.uint32)
    plan = group._plan(torch.float32)
    table = average.units(plan.batched, threebit.TILE, threebit.PART_TILES)
    dense = (gathered.view(torch.float32).view(2, -1).numpy(), *(index.numpy() for index in plan.dense["cpu"]))
    timed = {"rank by rank": rank_by_rank,
             "one call": lambda: group.average(layout, gathered, out, "numba", multiplier),
             "one call, its kernel alone": lambda: average.average_kernel(words, table, np.float32(2),
                                                                          multiplier.numpy(), out.numpy(), True,
                                                                          *dense)}
    seconds = {name: [] for name in timed}
    for _ in range(repeats):
        for name, call in timed.items():
            start = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - start)
    print(f"{len(numels)} parameters, {n} elements, {len(table)} work units; medians of {repeats}")
    for name, values in seconds.items():
        print(f"{statistics.median(values[repeats // 10:]) * 1e3:7.3f} ms  {name}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 400)
