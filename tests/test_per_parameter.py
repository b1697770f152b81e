"""Per-parameter compression inside a group (``gradcomp.compressors.per_parameter``).

The contract: compressing a group of parameters with :class:`PerParameter` is exactly compressing
each parameter alone (its own top-k budget, its own 2-bit scale), with parameters under
``dense_below`` sent whole; on every backend, the emulated CUDA kernels included, bit for bit.
"""
import pytest
import torch
from test_engine import OneRank

import gradcomp
import gradcomp.backends
from gradcomp.backends import cuda_source
from gradcomp.backends.sparse_parts import CompactParts
from gradcomp.compressors.per_parameter import PerParameter
from gradcomp.engine import Engine
from gradcomp.payload import Payload
from gradcomp.validation import PayloadError, validate_payload
from test_cuda_kernels import TINY, cuda_emulator, cuda_ops

# Mixed sizes: large and small parameters, sizes that are not multiples of 16, a scalar.
NUMELS = (3000, 10, 5000, 1, 2048, 7, 1500)
DENSE_BELOW = 1024
SPECS = ("topk:0.01", "topk:0.1", "topk:0.02,entries=compact", "twobit:rms", "twobit:0.5", "twobit:chunk", "threebit")


def make(n, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    grad = (torch.randn(n, generator=generator) * torch.rand(n, generator=generator) * 3).to(dtype)
    residual = torch.randn(n, generator=generator) * 0.1
    return grad, residual


@pytest.fixture(scope="module")
def emulated_cuda():
    """The CUDA kernels, run in the CPU emulation, standing in for the torch backend's ops."""
    try:
        launcher = cuda_emulator.EmulatedLauncher(cuda_emulator.build(cuda_emulator.Path(cuda_source.SOURCE_DIR)))
    except FileNotFoundError as error:
        pytest.skip(f"the CUDA emulation needs a C++20 compiler: {error}")
    return {
        "topk_compress": lambda g, ri, ro, v, i: cuda_ops.plan_topk_compress(launcher, TINY, g, ri, ro, v, i),
        "topk_decompress_add": lambda v, i, out: cuda_ops.plan_topk_decompress_add(launcher, TINY, v, i, out),
        "twobit_compress": lambda g, ri, ro, t, c: cuda_ops.plan_twobit_compress(launcher, TINY, g, ri, ro, t, c),
        "twobit_decompress_add": lambda c, t, out: cuda_ops.plan_twobit_decompress_add(launcher, TINY, c, t, out),
        "twobit_chunk_compress": lambda g, ri, ro, c, s: cuda_ops.plan_twobit_chunk_compress(launcher, TINY, g, ri, ro,
                                                                                            c, s),
        "twobit_chunk_decompress_add": lambda c, s, out: cuda_ops.plan_twobit_chunk_decompress_add(launcher, TINY, c,
                                                                                                  s, out),
        "threebit_compress": lambda g, ri, ro, c, s: cuda_ops.plan_threebit_compress(launcher, TINY, g, ri, ro, c, s),
        "threebit_decompress_add": lambda c, s, out: cuda_ops.plan_threebit_decompress_add(launcher, TINY, c, s, out),
    }


@pytest.fixture(params=["torch", "numba", "cuda-emulated"])
def backend(request, monkeypatch):
    """A backend name for ``compress(backend=...)``; the emulated CUDA kernels are swapped in
    for the torch ones for the test's duration."""
    if request.param == "numba":
        pytest.importorskip("numba", reason="the numba backend needs numba")
        return "numba"
    if request.param == "cuda-emulated":
        for op, fn in request.getfixturevalue("emulated_cuda").items():
            monkeypatch.setitem(gradcomp.backends.KERNELS, (op, "torch"), fn)
    return "torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("spec", SPECS)
def test_each_parameter_is_compressed_as_if_alone(backend, spec, dtype):
    base = gradcomp.from_spec(spec)
    grouped = PerParameter(base, NUMELS, dense_below=DENSE_BELOW)
    grad, residual = make(sum(NUMELS), dtype, seed=len(spec))
    residual_out = torch.full_like(residual, float("nan"))
    payload = grouped.compress(grad, residual, residual_out, backend=backend)

    decoded = torch.zeros(sum(NUMELS))
    grouped.decompress_add(payload, decoded, backend=backend)
    for part, own in grouped.parts_of(payload):
        lo, hi = part.offset, part.offset + part.numel
        acc = grad[lo:hi].float() + residual[lo:hi]
        if part.dense:
            assert part.numel < DENSE_BELOW
            assert torch.equal(own[f"{NUMELS.index(part.numel)}.dense"], acc.to(dtype))
            assert not own.buffer[part.numel * grad.element_size():].any()  # zeroed padding
            assert torch.equal(decoded[lo:hi], acc.to(dtype).float())
            assert torch.equal(residual_out[lo:hi], acc - acc.to(dtype).float())
            continue
        alone_out = torch.empty(part.numel)
        alone = base.compress(grad[lo:hi], residual[lo:hi], alone_out, backend=backend)
        assert torch.equal(own.buffer, alone.buffer), f"part at {lo} differs from its parameter compressed alone"
        assert torch.equal(residual_out[lo:hi], alone_out)
        alone_decoded = torch.zeros(part.numel)
        base.decompress_add(alone, alone_decoded, backend=backend)
        assert torch.equal(decoded[lo:hi], alone_decoded)
    # Error feedback: what was sent plus what is kept is what there was.
    torch.testing.assert_close(decoded + residual_out, grad.float() + residual, rtol=0, atol=1e-5)


def test_top_k_budget_is_per_parameter():
    grouped = PerParameter(gradcomp.TopK(0.01), (100_000, 2000), dense_below=0)
    grad = torch.cat([torch.full((100_000,), 10.0), torch.full((2000,), 0.001)])
    payload = grouped.compress(grad)
    sent = grouped.sent_indices(payload)
    # The small parameter keeps its own 1% (20 entries) although every entry of the large one is bigger.
    assert int((sent >= 100_000).sum()) == 20
    assert int((sent < 100_000).sum()) == 1000


def test_two_bit_scale_is_per_parameter():
    grouped = PerParameter(gradcomp.TwoBit("rms"), (4096, 2048), dense_below=0)
    grad = torch.cat([torch.randn(4096) * 100, torch.randn(2048) * 0.01])
    payload = grouped.compress(grad)
    scales = [float(own["scale"][0]) for _, own in grouped.parts_of(payload)]
    assert scales[0] > 50 and scales[1] < 0.02
    decoded = grouped.decompress(payload, torch.empty(6144))
    # With one scale for the bucket the small parameter would decode to zeros.
    assert int((decoded[4096:] != 0).sum()) > 100


def test_backends_agree_bit_for_bit(emulated_cuda, monkeypatch):
    pytest.importorskip("numba", reason="the numba backend needs numba")
    for spec in SPECS:
        grouped = PerParameter(gradcomp.from_spec(spec), NUMELS, dense_below=DENSE_BELOW)
        grad, residual = make(sum(NUMELS), torch.float32, seed=7)
        reference = grouped.compress(grad, residual, torch.empty_like(residual), backend="torch").buffer
        numba = grouped.compress(grad, residual, torch.empty_like(residual), backend="numba").buffer
        with monkeypatch.context() as patch:
            for op, fn in emulated_cuda.items():
                patch.setitem(gradcomp.backends.KERNELS, (op, "torch"), fn)
            emulated = grouped.compress(grad, residual, torch.empty_like(residual), backend="torch").buffer
        assert torch.equal(numba, reference), spec
        assert torch.equal(emulated, reference), spec


@pytest.mark.parametrize("spec", ["topk:0.01", "twobit:rms"])
def test_a_bad_part_is_rejected_naming_the_parameter(spec):
    grouped = PerParameter(gradcomp.from_spec(spec), NUMELS, dense_below=DENSE_BELOW)
    grad, _ = make(sum(NUMELS), torch.float32, seed=3)
    payload = grouped.compress(grad)
    validate_payload(grouped, payload, sum(NUMELS), rank=1)  # well formed
    bad = Payload(payload.layout, payload.buffer.clone())
    if spec.startswith("topk"):
        bad["2.indices"][0] = 10**6  # parameter 2: 5000 elements
    else:
        bad["2.scale"][0] = -1.0
    with pytest.raises(PayloadError, match=r"rank 1.*parameter 2 of the group"):
        validate_payload(grouped, bad, sum(NUMELS), rank=1)


def test_layout_depends_only_on_sizes_and_settings():
    grouped = PerParameter(gradcomp.TopK(0.01), NUMELS, dense_below=DENSE_BELOW)
    a = grouped.compress(torch.randn(sum(NUMELS)))
    b = grouped.compress(torch.zeros(sum(NUMELS)))
    assert a.layout == b.layout == grouped.layout(sum(NUMELS), torch.float32)
    with pytest.raises(ValueError, match="lays out"):
        grouped.layout(sum(NUMELS) + 1, torch.float32)
    with pytest.raises(TypeError, match="summable"):
        PerParameter(gradcomp.FP16(), NUMELS)


def test_engine_compresses_per_parameter_by_default_and_per_bucket_on_request():
    keys = tuple(f"p{i}" for i in range(len(NUMELS)))
    grad, _ = make(sum(NUMELS), torch.float32, seed=11)
    results = {}
    for granularity in ("parameter", "bucket"):
        engine = Engine(gradcomp.TopK(0.01), OneRank(), warmup_steps=0, backend="torch", granularity=granularity)
        handle = engine.start(grad.clone(), keys, NUMELS, 0)
        results[granularity] = (engine.finish(handle, handle.work).clone(), handle.compressor)
    per_parameter, bucket = results["parameter"], results["bucket"]
    assert isinstance(per_parameter[1], PerParameter) and not isinstance(bucket[1], PerParameter)
    expected = torch.zeros(sum(NUMELS))
    PerParameter(gradcomp.TopK(0.01), NUMELS, DENSE_BELOW).decompress_add(
        PerParameter(gradcomp.TopK(0.01), NUMELS, DENSE_BELOW).compress(grad), expected)
    assert torch.equal(per_parameter[0], expected)
    assert int((bucket[0] != 0).sum()) == gradcomp.TopK(0.01).k(sum(NUMELS))
    with pytest.raises(ValueError, match="granularity"):
        Engine(gradcomp.TopK(0.01), OneRank(), granularity="layer")


def test_the_per_parameter_benchmark_runs_and_reports_ratios(tmp_path):
    from experiments import bench_per_parameter

    out = tmp_path / "bench.json"
    results = bench_per_parameter.main(["--size", "20000", "--params", "7", "--repeats", "1", "--threads", "1",
                                        "--backend", "torch", "--json", str(out)])
    assert out.exists() and [c["spec"] for c in results["cases"]] == ["topk:0.01", "twobit:rms"]
    assert all(c["ratio"] > 0 and c["ratio_min"] <= c["ratio"] <= c["ratio_max"] for c in results["cases"])
    assert sum(bench_per_parameter.mixed_sizes(2**24, 100)) == 2**24


@pytest.mark.parametrize("residuals", ["none", "in-place", "separate"])
@pytest.mark.parametrize("spec", ["twobit:chunk", "threebit"])
def test_the_batched_ops_write_what_the_per_part_ops_write(backend, spec, residuals):
    """The quantizers with batched ops over a group's parts (one call a group) against the base's own op,
    called part by part through its payload views: payload, residual and decode bitwise equal."""
    base = gradcomp.from_spec(spec)
    grouped = PerParameter(base, NUMELS, dense_below=DENSE_BELOW)
    assert grouped._plan(torch.float32).batched  # the fast path is the one under test
    grad, residual = make(sum(NUMELS), torch.float32, seed=11)
    res_in = None if residuals == "none" else residual.clone()
    res_out = {"none": None, "in-place": res_in, "separate": torch.full_like(residual, float("nan"))}[residuals]
    payload = grouped.compress(grad, res_in, res_out, backend=backend)
    expected_residual = torch.full_like(residual, float("nan"))
    for part, own in grouped.parts_of(payload):
        lo, hi = part.offset, part.offset + part.numel
        if part.dense:
            expected_residual[lo:hi] = 0.0 if residuals == "none" else res_out[lo:hi]
            continue
        alone = base.compress(grad[lo:hi], None if res_in is None else residual[lo:hi], expected_residual[lo:hi],
                              backend=backend)
        assert torch.equal(own.buffer, alone.buffer), f"part at {lo}"
        out, alone_out = torch.randn(part.numel), None
        alone_out = out.clone()
        grouped_out = torch.zeros(sum(NUMELS))
        grouped_out[lo:hi] = out
        base.decompress_add(alone, alone_out, backend=backend)
        grouped.decompress_add(payload, grouped_out, backend=backend)
        assert torch.equal(grouped_out[lo:hi], alone_out)
    if res_out is not None:
        compressed = torch.tensor([not part.dense for part in grouped.parts for _ in range(part.numel)])
        assert torch.equal(res_out[compressed], expected_residual[compressed])


def _both_checks_agree(grouped, bad, n) -> bool:
    """Whether ``bad`` is rejected, asserting that the group's check (a few reductions over every part first)
    rejects it exactly when a part's own check does, naming the parameter, and that a group's decode (and
    for top-k its sent positions) is what the parts' give, or raises."""
    by_part = None
    for number, (part, own) in enumerate(grouped.parts_of(bad)):
        if not part.dense:
            try:
                grouped.base.check_payload(own, part.numel)
            except ValueError:
                by_part = by_part if by_part is not None else number
    if by_part is not None:
        if grouped.sparsifies:  # its decoders check indices themselves (quantizers: any code decodes)
            with pytest.raises(ValueError):
                grouped.decompress_add(bad, torch.zeros(n))
        with pytest.raises(PayloadError, match=rf"rank 1.*parameter {by_part} of the group"):
            validate_payload(grouped, bad, n, rank=1)
        return True
    validate_payload(grouped, bad, n, rank=1)
    decoded, expected, sent = torch.zeros(n), torch.zeros(n), []
    grouped.decompress_add(bad, decoded)
    for part, own in grouped.parts_of(bad):
        target = expected[part.offset:part.offset + part.numel]
        if part.dense:
            target.add_(own[own.layout.segments[0].name].float())
        else:
            grouped.base.decompress_add(own, target)
            if grouped.sparsifies:
                sent.append(grouped.base.sent_indices(own).long() + part.offset)
    torch.testing.assert_close(decoded, expected, rtol=0, atol=0, equal_nan=True)
    if grouped.sparsifies:
        assert torch.equal(grouped.sent_indices(bad), torch.cat(sent))
    return False


@pytest.fixture(params=["torch", "numba"])
def compact_form(request, monkeypatch):
    """Whose compact top-k encode and check run (:data:`gradcomp.backends.FORMS`' ``"sparse_parts"``), through the
    environment, so that the payload checks, which take no backend argument, follow it too."""
    if request.param == "numba":
        pytest.importorskip("numba", reason="the numba forms need numba")
    monkeypatch.setenv(gradcomp.backends.ENV_VAR, request.param)
    return request.param


@pytest.mark.parametrize("spec", ["twobit:chunk", "threebit", "topk:0.01", "topk:0.1", "topk:0.04,entries=compact"])
def test_the_batched_check_accepts_exactly_what_the_parts_accept(spec, compact_form):
    """Every single-word corruption of a group's payload (and, for top-k, an index repeated or moved):
    the group's check and decode agree with the parts' (:func:`_both_checks_agree`)."""
    grouped = PerParameter(gradcomp.from_spec(spec), NUMELS, dense_below=DENSE_BELOW)
    grad, _ = make(sum(NUMELS), torch.float32, seed=5)
    payload = grouped.compress(grad)
    validate_payload(grouped, payload, sum(NUMELS), rank=0)
    words = payload.buffer.view(torch.int32)
    generator = torch.Generator().manual_seed(0)
    patterns = [-1, 1 << 30, 0x40000001, 0x7F800000, 0x7FC00000, 0xFF800000 - (1 << 32), 3 << 28, 1]
    rejected = 0
    for word in torch.randperm(words.numel(), generator=generator)[:160].tolist() + [words.numel() - 1]:
        for pattern in patterns + [int(words[word - 1]), int(words[word]) + 1]:
            bad = Payload(payload.layout, payload.buffer.clone())
            bad.buffer.view(torch.int32)[word] = pattern
            rejected += _both_checks_agree(grouped, bad, sum(NUMELS))
    assert rejected > 100


def test_compact_parts_of_many_chunks_check_and_decode_as_the_parts_do(compact_form):
    """Compact top-k over parameters of several 65536-element chunks (a part's last chunk short): the batched
    compress, decode and sent positions equal the parts' own, and every corruption of a count (moved
    between chunks, so the total holds, or not) or of a 16-bit index is judged as the parts judge it."""
    numels = (70_000, 3000, 65_536, 10, 140_001)  # the last part's last chunk short: an index past the group
    n = sum(numels)
    base = gradcomp.TopK(0.02, entries="compact")
    grouped = PerParameter(base, numels, dense_below=DENSE_BELOW)
    assert isinstance(grouped._plan(torch.float32).sparse["cpu"], CompactParts)  # the fast path is under test
    grad, residual = make(n, torch.float32, seed=13)
    residual_out = torch.full_like(residual, float("nan"))
    payload = grouped.compress(grad, residual, residual_out)
    for part, own in grouped.parts_of(payload):
        if not part.dense:
            lo, hi = part.offset, part.offset + part.numel
            alone_out = torch.empty(part.numel)
            assert torch.equal(own.buffer, base.compress(grad[lo:hi], residual[lo:hi], alone_out).buffer)
            assert torch.equal(residual_out[lo:hi], alone_out)
    assert not _both_checks_agree(grouped, payload, n)
    generator = torch.Generator().manual_seed(1)
    rejected, accepted = 0, 0
    for number, (part, own) in enumerate(grouped.parts_of(payload)):
        if part.dense:
            continue
        for chunk in range(own["counts"].numel()):
            for moved in ((chunk, chunk + 1), (chunk + 1, chunk), (chunk, None)):
                bad = Payload(payload.layout, payload.buffer.clone())
                counts = grouped.parts_of(bad)[number][1]["counts"]
                if max(c for c in moved if c is not None) >= counts.numel():
                    continue
                counts[moved[0]] -= 1
                if moved[1] is not None:
                    counts[moved[1]] += 1
                verdict = _both_checks_agree(grouped, bad, n)
                rejected, accepted = rejected + verdict, accepted + (not verdict)
                if moved[1] is not None:  # a negative count, the part's total kept
                    counts[moved[1]] += int(counts[moved[0]]) + 1
                    counts[moved[0]] = -1
                    rejected += _both_checks_agree(grouped, bad, n)
        local = own["local"]
        for slot in torch.randperm(local.numel(), generator=generator)[:12].tolist() + [0, local.numel() - 1]:
            for value in (-1, 0, 32767, -32768, int(local[slot]) + 1, int(local[slot - 1])):
                bad = Payload(payload.layout, payload.buffer.clone())
                grouped.parts_of(bad)[number][1]["local"][slot] = value
                verdict = _both_checks_agree(grouped, bad, n)
                rejected, accepted = rejected + verdict, accepted + (not verdict)
    assert rejected > 50 and accepted > 10


@pytest.mark.parametrize("spec", ["topk:0.1", "topk:0.02,entries=compact", "threebit"])
def test_the_average_adds_what_the_check_decoded_bitwise(spec):
    """An allgather's check hands each rank's checked top-k entries to the average (no second decode of the
    same bytes): the average is bitwise the one that decodes every payload; quantizers' checks hand nothing."""
    from gradcomp.exchanges import average_gathered
    from gradcomp.validation import validate_gathered

    grouped = PerParameter(gradcomp.from_spec(spec), NUMELS, dense_below=DENSE_BELOW)
    payloads = [grouped.compress(make(sum(NUMELS), torch.float32, seed=20 + rank)[0]) for rank in range(3)]
    gathered = torch.cat([payload.buffer for payload in payloads])
    layout = payloads[0].layout
    checked = validate_gathered(grouped, layout, gathered, sum(NUMELS))
    assert [c is not None for c in checked] == [spec.startswith("topk")] * 3
    decoded = average_gathered(grouped, layout, gathered, torch.full((sum(NUMELS),), float("nan")))
    added = average_gathered(grouped, layout, gathered, torch.full((sum(NUMELS),), float("nan")), checked=checked)
    assert torch.equal(added, decoded) and bool(decoded.abs().sum() > 0)
    if checked[0] is not None:  # what is added is the checked entries, not a second decode of the bytes
        first_thrice = average_gathered(grouped, layout, gathered, torch.zeros(sum(NUMELS)), checked=[checked[0]] * 3)
        assert not torch.equal(first_thrice, decoded)


def test_the_numba_compact_forms_write_and_read_the_torch_forms_bits():
    """Compact encode and check over parts of several chunks, values at bfloat16's rounding edges (ties to
    even, the largest finite, infinities, subnormals, signed zeros): the numba forms' payload bytes, residuals
    and checked entries are the torch forms' (no NaN: the top-k contract leaves its bits open)."""
    pytest.importorskip("numba", reason="the numba forms need numba")
    numels = (70_000, 3000, 65_536, 10, 140_001)
    grouped = PerParameter(gradcomp.TopK(0.02, entries="compact"), numels, dense_below=DENSE_BELOW)
    parts = grouped._plan(torch.float32).sparse["cpu"]
    kept = [part for part in grouped.parts if not part.dense]
    ks = [grouped.base.k(part.numel) for part in kept]
    generator = torch.Generator().manual_seed(3)
    indices = torch.cat([torch.randperm(part.numel, generator=generator)[:k].sort().values for part, k in
                         zip(kept, ks)]).to(torch.int32)
    edges = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.3895e38, float("inf"), -float("inf"),
                          1e-40, -1e-45, 0.0, -0.0])
    values = torch.randn(sum(ks), generator=generator)
    values[:edges.numel()] = edges
    payload = grouped._plan(torch.float32).whole.allocate(torch.device("cpu"))
    for residual in (torch.randn(sum(numels), generator=generator), None):
        buffers, residuals = [], []
        for backend in ("torch", "numba"):
            buffer = payload.buffer.clone().fill_(0)
            out = None if residual is None else residual.clone()
            parts.encode(values, indices, buffer, out, backend)
            buffers.append(buffer)
            residuals.append(out)
        assert torch.equal(buffers[0], buffers[1])
        if residual is not None:
            # an infinity sent leaves inf - inf, a NaN, in the residual: the same entries NaN on both
            torch.testing.assert_close(residuals[1], residuals[0], rtol=0, atol=0, equal_nan=True)
        checked = [parts.entries(buffers[0], torch.float32, backend) for backend in ("torch", "numba")]
        assert torch.equal(checked[0][0], checked[1][0])
        assert torch.equal(checked[0][1].view(torch.int16), checked[1][1].view(torch.int16))
