"""Optimizer-aware compression: stages of the engine that change *what* is compressed.

* :class:`DGC`: for SGD with momentum. The compression state owns the momentum (DGC's momentum
  correction and factor masking); the optimizer runs without momentum.
* :class:`CompressedAdamW`: for AdamW. Dense warm-up, then the variance is frozen and the
  momentum is what ranks compress and exchange (1-bit Adam's recipe).

Both plug into the engine's ``transform`` slot (``DGC`` itself, ``CompressedAdamW.transform``).
"""
from gradcomp.optim.adam import CompressedAdamW
from gradcomp.optim.dgc import DGC

__all__ = ["DGC", "CompressedAdamW"]
