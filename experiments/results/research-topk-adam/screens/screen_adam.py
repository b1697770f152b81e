"""Top-k under the recipe's frozen-variance Adam: two changes screened against the study's run.

* ``beta1=X``: from the first compressed step on, each group's Adam ``beta1`` is ``X`` (the first moment
  each rank compresses is ``m_i = X m_i + (1 - X) g_i``): an exponential average keeps its steady state
  whatever ``X``, and a shorter memory leaves room for the delay error feedback adds (a coordinate held
  back arrives late, which acts as momentum of its own; ``../research-topk-momentum/``).
* ``delay``: from the first compressed step on, each group's ``beta1`` is SGD's stage's shortened momentum at
  the step's density (``compressed_momentum(0.9, delay_at(rho))``: 0.8 at 1 %), the first moment still exchanged.
* ``gradient-delay``: each rank's gradient exchanged in update units (as under the quantizers), its first
  moment formed after the exchange with that shortened ``beta1`` (SGD's stage, in Adam's units).
* ``bucket``: each group's top-k over the whole group (``granularity="bucket"``, as the recipe does under
  SGD) in place of a share per parameter: in Adam's update units every tensor is on one scale.

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-topk-adam/screens/screen_adam.py VARIANT STEPS LOG WORKLOAD [RUN_STEPS]``
(``RUN_STEPS``: the run's length, the study's by default; 200 is the main job's quick cell).
"""
import sys

import torch

from experiments import loop as loops
from experiments import simrun
from experiments.convergence import RunSpec
from experiments.screening import recorded_engines, run_prefix
from gradcomp import recipe
from gradcomp.optim import FrozenVarianceAdam
from gradcomp.optim.delayed_momentum import compressed_momentum, delay_at


def main(variant: str, stop: int, log: str, workload: str, run_steps: str = "") -> None:
    torch.set_num_threads(1)
    engines = recorded_engines()
    before_step = loops.before_step

    def adjusted(loop, model, optimizer, scaler=None):
        norm = before_step(loop, model, optimizer, scaler)
        compressor = engines[0].compressor_now()
        if compressor is not None and variant.startswith("beta1="):
            for group in optimizer.param_groups:
                group["betas"] = (float(variant.split("=")[1]), group["betas"][1])
        if compressor is not None and variant in ("delay", "gradient-delay"):
            beta1 = compressed_momentum(0.9, delay_at(compressor.density))
            for group in optimizer.param_groups:
                group["betas"] = (beta1, group["betas"][1])
        return norm

    loops.before_step = adjusted
    if variant == "bucket":
        recipe._granularity = lambda optimizer, compressor: "bucket" if compressor.sparsifies else None
    if variant == "gradient-delay":
        import gradcomp.optim as optim

        class GradientExchange(FrozenVarianceAdam):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **{**kwargs, "exchange": "gradient"})

        optim.FrozenVarianceAdam = GradientExchange
    if run_steps:
        steps = int(run_steps)
        simrun.run(RunSpec(workload, "adamw", "topk", 0, steps, max(1, steps // 50)), log)
    else:
        run_prefix(stop, log, workload, "adamw", "topk")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], *sys.argv[4:])
