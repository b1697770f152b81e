"""What the passes a fused divide-compress / average-multiply would remove cost in the step (informal, not gradcomp).

World size 1 (no wire), charlm-small under AdamW, three replicas stepped in turn after the recipe's start and ramp:
dense, the 2-bit recipe with the stage's passes (``A``: the stage's ``divisor`` hidden, as the code was before the
kernels applied it), the 2-bit recipe with those passes skipped (``B``: the stage's copy and division before the
compress, its product after the average, the average's division; wrong arithmetic, timing only) and the recipe as
it is (``C``: the kernels divide as they load, the average is multiplied as it is finished). Prints each one's median
step and its median paired difference to dense's. From the repository root::

    PYTHONPATH=. OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 \\
        python experiments/results/research-step-overhead/fusion_bound.py 300
"""
import os
import statistics
import sys
import warnings

from experiments import launch, step_times, suite
from experiments import loop as loops
from gradcomp.exchanges import allgather, base
from gradcomp.optim import frozen_adam
from gradcomp.payload import Payload

SKIP = [False]
MODE = [None]  # the replica being stepped
_divisor = frozen_adam.FrozenVarianceAdam.divisor
_before, _after = frozen_adam.FrozenVarianceAdam.before_compress, frozen_adam.FrozenVarianceAdam.after_average
_average = base.average_gathered


def divisor(self, keys, numels):
    return _divisor(self, keys, numels) if MODE[0] == "C" else None


def before_compress(self, keys, numels, grad, compressor=None):
    if not SKIP[0]:
        return _before(self, keys, numels, grad, compressor)
    self._pending[tuple(keys)] = []
    return grad  # the compress reads it and does not write it


def after_average(self, keys, numels, average, dense):
    if not SKIP[0]:
        _after(self, keys, numels, average, dense)


def average_gathered(compressor, layout, gathered, out, backend=None, checked=(), multiplier=None):
    if not SKIP[0]:
        return _average(compressor, layout, gathered, out, backend, checked, multiplier)
    out.zero_()
    for rank in range(gathered.numel() // layout.nbytes):
        payload = Payload(layout, gathered[rank * layout.nbytes: (rank + 1) * layout.nbytes])
        done = checked[rank] if rank < len(checked) else None
        if done is None:
            compressor.decompress_add(payload, out, backend)
        else:
            compressor.add_checked(payload, done, out, backend)
    return out


def main(count: int) -> None:
    warnings.filterwarnings("ignore")
    frozen_adam.FrozenVarianceAdam.before_compress = before_compress
    frozen_adam.FrozenVarianceAdam.after_average = after_average
    frozen_adam.FrozenVarianceAdam.divisor = divisor
    allgather.average_gathered = average_gathered
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29615")
    launch.init_rank(0, 1, threads=1, timeout=600, cuda=False)
    workload = suite.build("charlm-small", 0, 32)
    loop = loops.loop_for("charlm-small", "adamw", step_times.PLANNED_STEPS)
    net = workload.build_model()
    methods = {"dense": "dense", "A": "twobit", "B": "twobit", "C": "twobit"}
    replicas = {key: step_times._replica(method, net, loop, 200) for key, method in methods.items()}
    done = {key: 0 for key in replicas}

    def run(key, steps):
        seconds = []
        for _ in range(steps):
            SKIP[0], MODE[0] = key == "B", key
            try:
                seconds.append(step_times._step(replicas[key], workload, loop, 0, done[key]))
            finally:
                SKIP[0] = False
            done[key] += 1
        return seconds

    for key, method in methods.items():
        step_times._to_final_setting(replicas[key], lambda steps, key=key: run(key, steps), method)
    times = {key: [] for key in replicas}
    order = list(replicas)
    for i in range(count):
        for j in range(len(order)):
            key = order[(i + j) % len(order)]
            times[key] += run(key, 1)
    for key in order:
        paired = statistics.median(a - b for a, b in zip(times[key], times["dense"]))
        print(f"{key:6s} {statistics.median(times[key]) * 1e3:7.2f} ms  vs dense {paired * 1e3:+.2f} ms")
    for key in ("B", "C"):
        print(f"{key} - A  {statistics.median(b - a for a, b in zip(times['A'], times[key])) * 1e3:+.2f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
