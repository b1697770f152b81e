"""gradcomp: gradient compression with error feedback for PyTorch data-parallel training.

Importing this package needs only torch; numba and cupy are loaded by the kernel
backends on first use.
"""
from gradcomp.compressors import BF16, FP16, Compressor, Identity, TopK, TwoBit, from_spec
from gradcomp.engine import Engine, SettingsMismatchError
from gradcomp.error_feedback import ErrorFeedback
from gradcomp.payload import Payload, PayloadLayout
from gradcomp.policy import Auto
from gradcomp.validation import PayloadError

__version__ = "0.1.0"

__all__ = ["Compressor", "TopK", "TwoBit", "Identity", "FP16", "BF16", "from_spec", "ErrorFeedback", "Payload",
           "PayloadLayout", "Engine", "SettingsMismatchError", "PayloadError", "Auto"]
