"""The average of every rank's quantized payloads in one call (``threebit_average``, ``twobit_chunk_average``):
bitwise the rank-by-rank decode it replaces, with and without the stage's multiplier, and its finite verdict."""
import pytest
import torch

import gradcomp
import gradcomp.backends
from gradcomp.backends import kernel_parts
from gradcomp.compressors.per_parameter import PerParameter
from gradcomp.exchanges import average_gathered
from gradcomp.payload import Payload

NUMELS = (3000, 10, 5000, 1, 2048, 7, 1500, 1281)  # parts whose last word or chunk is partly used, dense ones
DENSE_BELOW = 1024
NUMBA = pytest.param("numba", marks=pytest.mark.skipif(not gradcomp.backends.is_available("numba"),
                                                      reason="numba is not installed"))
BACKENDS = ["torch", NUMBA]


def _gathered(group, world_size, dtype, poison):
    """Every rank's payload of ``group`` one after another; ``poison``: rank 1's gradient has a NaN and an
    infinity (its codes then decode to NaN) and rank 2's is huge."""
    payloads = []
    for rank in range(world_size):
        grad = torch.randn(group.numel, generator=torch.Generator().manual_seed(rank)) * (1e30 if rank == 2 else 1.0)
        if poison and rank == 1:
            grad[[5, 4000, 3003]] = torch.tensor([float("nan"), float("inf"), float("-inf")])
        payloads.append(group.compress(grad.to(dtype), backend="torch"))
    return payloads[0].layout, torch.cat([payload.buffer for payload in payloads])


def _rank_by_rank(group, layout, gathered, multiplier):
    """The unfused average: zero, add each rank's decode, divide, multiply."""
    out, nbytes = torch.zeros(group.numel), layout.nbytes
    for start in range(0, gathered.numel(), nbytes):
        group.decompress_add(Payload(layout, gathered[start: start + nbytes]), out, "torch")
    out.div_(gathered.numel() // nbytes)
    return out if multiplier is None else out.mul_(multiplier)


def _assert_bitwise(found, expected):
    assert torch.equal(found.isnan(), expected.isnan())
    assert torch.equal(found.nan_to_num(0.0).view(torch.int32), expected.nan_to_num(0.0).view(torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", ["threebit", "twobit:chunk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("multiplied", [False, True])
def test_the_one_call_average_is_bitwise_the_rank_by_rank_decode(monkeypatch, backend, spec, dtype, world_size,
                                                                  multiplied):
    monkeypatch.setenv(gradcomp.backends.ENV_VAR, backend)
    group = PerParameter(gradcomp.from_spec(spec), NUMELS, dense_below=DENSE_BELOW)
    assert group.averages
    layout, gathered = _gathered(group, world_size, dtype, poison=True)
    multiplier = None
    if multiplied:
        multiplier = torch.rand(group.numel, generator=torch.Generator().manual_seed(9)) * 1e-3 + 1e-6
        multiplier[7] = 0.0
    out = torch.full((group.numel,), 123.0)  # overwritten everywhere, dense parts included
    found = average_gathered(group, layout, gathered, out, multiplier=multiplier)
    assert found is out
    _assert_bitwise(found, _rank_by_rank(group, layout, gathered, multiplier))
    verdict = group.average(layout, gathered, torch.empty(group.numel), backend, multiplier)
    expected = bool(torch.isfinite(found).all())
    assert verdict == expected if backend == "numba" else verdict is None  # the looped form does not say
    if world_size > 1:
        assert not expected  # rank 1's NaN reaches every element of its chunk


@pytest.mark.parametrize("spec", ["threebit", "twobit:chunk"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_the_verdict_sees_an_overflow_and_a_clean_average(spec, world_size):
    """Finite payloads whose average times the multiplier overflows are not finite; without it they are."""
    if not gradcomp.backends.is_available("numba"):
        pytest.skip("numba is not installed")
    group = PerParameter(gradcomp.from_spec(spec), NUMELS, dense_below=DENSE_BELOW)
    layout, gathered = _gathered(group, world_size, torch.float32, poison=False)
    out = torch.empty(group.numel)
    assert group.average(layout, gathered, out, "numba") is True
    multiplier = torch.ones(group.numel)
    at = 3010 + int(out[3010:8010].abs().argmax())  # a compressed part's largest element (|average| > 1)
    multiplier[at] = 3e38
    assert group.average(layout, gathered, out, "numba", multiplier) is False
    multiplier[at], multiplier[3004] = 1.0, float("inf")  # a dense part's element
    assert group.average(layout, gathered, out, "numba", multiplier) is False


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", ["threebit", "twobit:chunk"])
def test_a_part_longer_than_one_work_unit_is_averaged_whole(monkeypatch, backend, spec):
    """A part of more blocks than a parallel work unit holds (256 tiles of 640, 1024 chunks of 64) is cut into
    units; every element is still written once, bitwise."""
    monkeypatch.setenv(gradcomp.backends.ENV_VAR, backend)
    group = PerParameter(gradcomp.from_spec(spec), (400_001, 3, 170_000), dense_below=DENSE_BELOW)
    layout, gathered = _gathered(group, 2, torch.float32, poison=False)
    multiplier = torch.rand(group.numel) + 0.5
    found = average_gathered(group, layout, gathered, torch.full((group.numel,), float("nan")), multiplier=multiplier)
    _assert_bitwise(found, _rank_by_rank(group, layout, gathered, multiplier))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", ["threebit", "twobit:chunk"])
def test_the_average_refuses_parts_outside_its_arrays(backend, spec):
    group = PerParameter(gradcomp.from_spec(spec), NUMELS, dense_below=DENSE_BELOW)
    layout, gathered = _gathered(group, 2, torch.float32, poison=False)
    words, parts = gathered.view(torch.int32).view(2, -1), group._plan(torch.float32).batched
    average = kernel_parts(group.base.part_ops[2], torch.device("cpu"), backend)
    with pytest.raises(ValueError, match="does not fit"):
        average(words[:, :-4].contiguous(), parts, torch.empty(group.numel))
    with pytest.raises(ValueError, match="does not fit"):
        average(words, parts, torch.empty(group.numel - 1))


class OneRank(gradcomp.engine.Transport):
    """The collectives of a world of one rank: the gather of one payload is a copy of it."""

    world_size, rank = 1, 0

    def allgather(self, buffer, name):
        return buffer.clone()


class Commits:
    """A transform that sends the gradient as it is and records each commit's verdict."""

    def __init__(self):
        self.accepted = []

    def before_compress(self, keys, numels, grad, compressor):
        return grad.clone()

    def after_compress(self, keys, payload, compressor, numel):
        pass

    def dense(self, keys, numels, grad):
        return grad

    def commit(self, keys, accept):
        self.accepted.append(bool(accept))

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class Multiplies(Commits):
    """... and multiplies the average after the exchange by ``product`` (as a stage back in its units)."""

    def __init__(self, product):
        super().__init__()
        self.product = product

    def after_average(self, keys, numels, average, dense):
        average.mul_(self.product)


def _engine_step(monkeypatch, transform, grad):
    """One step of a two-parameter group through an engine on one rank (3-bit, numba); returns the handle and how
    often the commit read the average for its finite check."""
    reads = []
    finite = gradcomp.exchanges.base.all_finite
    monkeypatch.setattr(gradcomp.exchanges.base, "all_finite", lambda average: reads.append(1) or finite(average))
    engine = gradcomp.engine.Engine(gradcomp.from_spec("threebit"), OneRank(), warmup_steps=0, min_numel=0,
                                    backend="numba", transform=transform)
    handle = engine.start(grad, ("a", "b"), [3000, 5000], "group")
    engine.finish(handle, handle.work)
    return handle, len(reads)


@pytest.mark.parametrize("poisoned", [False, True])
def test_the_commit_takes_the_averages_verdict_without_reading_it_again(monkeypatch, poisoned):
    if not gradcomp.backends.is_available("numba"):
        pytest.skip("numba is not installed")
    grad = torch.randn(8000, generator=torch.Generator().manual_seed(0))
    if poisoned:
        grad[4321] = float("inf")
    transform = Commits()
    handle, reads = _engine_step(monkeypatch, transform, grad)
    assert handle.finite is (not poisoned) and reads == 0
    assert transform.accepted == [not poisoned]


def test_a_product_after_the_average_is_read_again(monkeypatch):
    """A transform's ``after_average`` changes the average after its verdict: the commit reads what it made."""
    if not gradcomp.backends.is_available("numba"):
        pytest.skip("numba is not installed")
    transform = Multiplies(float("inf"))
    handle, reads = _engine_step(monkeypatch, transform, torch.randn(8000, generator=torch.Generator().manual_seed(0)))
    assert handle.finite is None and reads == 1
    assert transform.accepted == [False]


@pytest.mark.parametrize("spec", ["threebit", "twobit:chunk"])
def test_the_numba_average_refuses_dense_indices_outside_their_arrays(spec):
    if not gradcomp.backends.is_available("numba"):
        pytest.skip("numba is not installed")
    group = PerParameter(gradcomp.from_spec(spec), NUMELS, dense_below=DENSE_BELOW)
    layout, gathered = _gathered(group, 2, torch.float32, poison=False)
    words, parts = gathered.view(torch.int32).view(2, -1), group._plan(torch.float32).batched
    values = gathered.view(torch.float32).view(2, -1)
    elements, slots = group._on(group._plan(torch.float32).dense, torch.device("cpu"))
    average = kernel_parts(group.base.part_ops[2], torch.device("cpu"), "numba")
    out = torch.zeros(group.numel)
    for bad in ((values, elements + group.numel, slots), (values, elements, slots + values.shape[1]),
                (values, elements, slots[:-1]), (values, elements.int(), slots)):
        with pytest.raises(ValueError, match="dense"):
            average(words, parts, out, None, bad)
    with pytest.raises(TypeError, match="dense values"):
        average(words, parts, out, None, (values[:1], elements, slots))
    assert not out.any()  # nothing was written
