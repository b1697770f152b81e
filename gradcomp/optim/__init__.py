"""Optimizer-aware compression: stages of the engine that work inside the optimizer's step.

* :class:`FrozenVarianceAdam`: for the user's own ``torch.optim.Adam``/``AdamW``. Dense start,
  then the variance is frozen and ranks compress the gradient in Adam's update units (a sparsifier's late
  gradients caught up in the step, :mod:`gradcomp.optim.catch_up`; or each rank's first moment,
  ``exchange="momentum"``); ``.grad`` keeps the average in gradient units and the frozen-variance update runs in
  the optimizer's step.
* :class:`DelayedMomentumSGD`: for the user's own ``torch.optim.SGD`` with momentum under a
  sparsifier. ``.grad`` keeps the average gradient; while a parameter's group is compressed its step
  applies each coordinate's late gradient as the momentum would have applied it on time.

The one-call recipe (:mod:`gradcomp.recipe`, ``gradcomp.register(model, compressor, optimizer=, total_steps=)``) picks
the stage and derives its settings from the run; the measured figures are in the README.
Assembling it by hand::

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stage = FrozenVarianceAdam(optimizer, model.named_parameters(), freeze_step=100, exchange="gradient")
    gradcomp.hooks.ddp.register(ddp_model, "twobit:chunk", schedule=DenseWarmup(100), transform=stage)
"""
from gradcomp.optim.delayed_momentum import DelayedMomentumSGD
from gradcomp.optim.frozen_adam import FrozenVarianceAdam

__all__ = ["DelayedMomentumSGD", "FrozenVarianceAdam"]
