"""The GPU self-check's comparison (experiments.gpu_selfcheck.check_correctness) on CPU: it passes
kernels that agree with the reference and counts those that do not."""
import pytest
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


def test_the_compact_check_passes_forms_that_agree_and_counts_one_that_does_not(monkeypatch, capsys):
    """check_compact on CPU with the numba forms (the GPU run compares the cuda forms alike), then with an encode
    that rounds one value differently."""
    assert gpu_selfcheck.check_compact(torch.device("cpu"), "numba") == 0
    assert "MISMATCH" not in capsys.readouterr().out
    encode = backends.KERNELS[("compact_encode/sparse_parts", "numba")]

    def rounding_one_off(parts, values, indices, buffer, residual_out):
        return encode(parts, torch.cat([values[:1].nextafter(torch.tensor(9.0)), values[1:]]), indices, buffer,
                      residual_out)

    monkeypatch.setitem(backends.KERNELS, ("compact_encode/sparse_parts", "numba"), rounding_one_off)
    assert gpu_selfcheck.check_compact(torch.device("cpu"), "numba") == 1
    assert "MISMATCH compact top-k" in capsys.readouterr().out


def test_a_mismatch_names_its_first_elements_and_their_bits():
    """A GPU run's report must say what differs, not only how much: -0.0 against +0.0 is two
    elements apart in bits although equal as numbers, and any two NaNs count as equal."""
    got = torch.tensor([1.0, -0.0, float("nan"), 2.0])
    expected = torch.tensor([1.0, 0.0, float("nan"), 3.0])
    found = gpu_selfcheck.mismatches(got, expected)
    assert found == 2
    assert "[1] got -0.0 (80000000) expected 0.0 (00000000)" in str(found)
    assert "[3] got 2.0 (40000000) expected 3.0 (40400000)" in str(found)
    assert gpu_selfcheck.mismatches(got.half(), expected.half()).detail.count("[") == 2


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ddp_check_runs_a_backend_against_the_reference_in_real_ranks(capsys):
    """experiments.gpu_ddp_check, the end-to-end check of a GPU run, on CPU: numba against torch
    in two Gloo ranks, every compressor and the recipe, bitwise equal."""
    from experiments import gpu_ddp_check

    assert gpu_ddp_check.main(["--device", "cpu", "--backend", "numba", "--steps", "6"]) == 0
    out = capsys.readouterr().out
    assert out.count("bitwise equal") == len(gpu_ddp_check.RUNS)


def test_hostile_check_passes_a_careful_decoder_and_catches_a_careless_one(monkeypatch, capsys):
    """experiments.gpu_hostile_check, run on the GPU under compute-sanitizer, here on CPU: the numba
    decoders behave in every case; a decoder that writes before checking is caught."""
    from experiments import gpu_hostile_check

    assert gpu_hostile_check.main(["--device", "cpu", "--backend", "numba"]) == 0
    careful = backends.kernel

    def careless(op, device, backend):
        if op != "topk_decompress_add":
            return careful(op, device, backend)
        return lambda values, indices, out: out.add_(1.0)  # writes whatever it was sent

    monkeypatch.setattr(backends, "kernel", careless)
    assert gpu_hostile_check.main(["--device", "cpu", "--backend", "numba"]) == 1
    assert "FAIL top-k unsorted" in capsys.readouterr().out
