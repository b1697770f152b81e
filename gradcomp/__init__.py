"""gradcomp: gradient compression with error feedback for PyTorch data-parallel training.

Importing this package needs only torch; numba and cupy are loaded by the kernel
backends on first use.
"""
from gradcomp.compressors import BF16, FP16, Compressor, Identity, TopK, TwoBit
from gradcomp.error_feedback import ErrorFeedback
from gradcomp.payload import Payload, PayloadLayout

__version__ = "0.1.0"

__all__ = ["Compressor", "TopK", "TwoBit", "Identity", "FP16", "BF16", "ErrorFeedback", "Payload", "PayloadLayout"]
