"""Optimizer-aware compression: stages of the engine that change *what* is compressed.

* :class:`DGC`: for SGD with momentum. The compression state owns the momentum (DGC's momentum
  correction and factor masking); the optimizer runs without momentum.
* :class:`CompressedAdamW`: for AdamW. Dense warm-up, then the variance is frozen and the
  momentum is what ranks compress and exchange (1-bit Adam's recipe).

Both plug into the engine's ``transform`` slot (``DGC`` itself, ``CompressedAdamW.transform``).

Which recipe (measured by ``python -m experiments.convergence``: charlm-small, 2 ranks x 1
thread, DDP over Gloo on a loopback shaped to 1 Gbit/s, 2000 steps, seed 0, held-out loss;
``experiments/results/convergence/``)::

    SGD + momentum 0.9     dense 1.640
      top-k 1%: DGC + SparsityRamp (2 dense steps, 100-step stages)     1.662 (+1.3%), 17x fewer bytes
      the same without error feedback (at 800 steps: 2.425 vs 2.044)    worse
      2-bit: TwoBit("rms") + DGC (no masking) + 100 dense steps         2.512 (+53%), 8.6x fewer bytes
    AdamW                  dense 1.420
      top-k 1%: CompressedAdamW (freeze at 100) + SparsityRamp(100, 50) 1.470 (+3.5%), 10.9x fewer bytes
      2-bit: CompressedAdamW (freeze at 100), TwoBit("rms") on the momentum 1.433 (+0.9%), 8.6x fewer bytes

SGD-momentum users: ``optimizer = SGD(..., momentum=0.0)`` and ``transform=DGC(named, momentum=0.9,
optimizer=optimizer)`` with ``schedule=gradcomp.schedule.recommended(TopK(0.01))``. AdamW users:
``CompressedAdamW`` with ``SparsityRamp(dense_steps=freeze_step)``; plain error feedback into a
live torch AdamW costs +50% held-out loss at 2000 steps (research simulation: 2.132 vs 1.420).
2-bit with SGD-momentum did not reach parity with any recipe tried; prefer top-k there.
"""
from gradcomp.optim.adam import CompressedAdamW
from gradcomp.optim.dgc import DGC
from gradcomp.optim.frozen_adam import FrozenVarianceAdam

__all__ = ["DGC", "CompressedAdamW", "FrozenVarianceAdam"]
