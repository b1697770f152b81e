"""gradcomp: gradient compression with error feedback for PyTorch data-parallel training.

The public API is :data:`__all__`:

* the compressors (``TopK``, ``TwoBit``, ``ThreeBit``, ``Identity``, ``FP16``, ``BF16``, their base
  ``Compressor``) and ``from_spec`` (``"topk:0.01"`` -> ``TopK(density=0.01)``);
* ``register(model, compressor, optimizer=..., total_steps=...)``: compress a DDP model's
  gradients in one call, with the recipe for the optimizer derived from the run;
* ``Auto``: a per-bucket choice of method from measurements of the link;
* the schedules ``DenseWarmup``, ``SparsityRamp`` and ``recommended`` (also ``gradcomp.schedule``);
* the optimizer stage ``FrozenVarianceAdam`` (also ``gradcomp.optim``) and ``RecipeNotice``, the warning
  category of the recipe's decisions;
* the errors ``PayloadError`` and ``SettingsMismatchError``.

Horovod users import :mod:`gradcomp.hooks.horovod` (it needs Horovod). The parts the
integrations are built from (``gradcomp.engine.Engine``, ``gradcomp.payload.Payload`` and
``PayloadLayout``, ``gradcomp.error_feedback.ErrorFeedback``) are importable from their modules
and are not part of this namespace.

Importing this package needs only torch; numba and cupy are loaded by the kernel backends on
first use, Horovod only by :mod:`gradcomp.hooks.horovod`.
"""
from gradcomp import schedule  # noqa: F401  the module, as gradcomp.schedule
from gradcomp.compressors import BF16, FP16, Compressor, Identity, ThreeBit, TopK, TwoBit, from_spec
from gradcomp.engine import SettingsMismatchError
from gradcomp.optim import FrozenVarianceAdam
from gradcomp.policy import Auto
from gradcomp.schedule import DenseWarmup, SparsityRamp, recommended
from gradcomp.setup import RecipeNotice
from gradcomp.validation import PayloadError

# Last: the DDP integration imports the pieces above (gradcomp.engine, gradcomp.inflight, ...).
from gradcomp.hooks.ddp import register  # noqa: E402  isort: skip

__version__ = "0.1.0"

__all__ = [
    "Compressor", "TopK", "TwoBit", "ThreeBit", "Identity", "FP16", "BF16", "from_spec",
    "register", "Auto",
    "DenseWarmup", "SparsityRamp", "recommended",
    "FrozenVarianceAdam", "RecipeNotice",
    "PayloadError", "SettingsMismatchError",
]  # fmt: skip
