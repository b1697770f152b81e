"""Optimizer-aware compression: stages of the engine that change *what* is compressed.

* :class:`DGC`: for SGD with momentum. The compression state owns the momentum (DGC's momentum
  correction and factor masking); the optimizer runs without momentum.
* :class:`FrozenVarianceAdam`: for the user's own ``torch.optim.Adam``/``AdamW``. Dense warm-up,
  then the variance is frozen and the momentum is what ranks compress and exchange (1-bit Adam's
  recipe), applied to that optimizer in place.
* :class:`CompressedAdamW`: the same recipe as an optimizer of its own.

All plug into the engine's ``transform`` slot (``DGC`` and ``FrozenVarianceAdam`` themselves,
``CompressedAdamW.transform``). The one-call recipe (:mod:`gradcomp.recipe`, ``gradcomp.register(
model, compressor, optimizer=, total_steps=, scheduler=)``) picks the stage for the optimizer and
derives its settings from the run; the measured figures are in the README ("Which recipe") and
``experiments/results/convergence/``. Assembling a stage by hand stays possible::

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0)   # the momentum moves here
    dgc = DGC(model.named_parameters(), momentum=0.9, optimizer=optimizer)
    gradcomp.register(ddp_model, TopK(0.01), schedule=SparsityRamp(2, 100), transform=dgc)
"""
from gradcomp.optim.adam import CompressedAdamW
from gradcomp.optim.dgc import DGC
from gradcomp.optim.frozen_adam import FrozenVarianceAdam

__all__ = ["DGC", "CompressedAdamW", "FrozenVarianceAdam"]
