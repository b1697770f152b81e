"""The GPU self-check's comparison (experiments.gpu_selfcheck.check_correctness) on CPU: it passes
kernels that agree with the reference and counts those that do not."""
import torch

from experiments import gpu_selfcheck
from gradcomp import backends
from gradcomp.backends import torch_ops

SIZES = (1, 17, 1000)


def numba_kernels():
    assert backends.is_available("numba")
    return {op: backends.kernel(op, torch.device("cpu"), "numba") for op in backends.OPS}


def test_kernels_that_agree_with_the_reference_pass(capsys):
    reference = {op: getattr(torch_ops, op) for op in backends.OPS}
    assert gpu_selfcheck.check_correctness(torch.device("cpu"), numba_kernels(), reference, sizes=SIZES) == 0
    assert "MISMATCH" not in capsys.readouterr().out


def test_a_kernel_that_disagrees_is_counted_and_named(capsys):
    reference = {op: getattr(torch_ops, op) for op in backends.OPS}
    kernels = numba_kernels()

    def off_by_one(values, indices, out):  # decodes one entry twice
        reference["topk_decompress_add"](values, indices, out)
        out[indices[:1].long()] += values[:1].to(out.dtype)

    kernels["topk_decompress_add"] = off_by_one
    assert gpu_selfcheck.check_correctness(torch.device("cpu"), kernels, reference, sizes=SIZES) > 0
    assert "MISMATCH topk_decompress_add" in capsys.readouterr().out
