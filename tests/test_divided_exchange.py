"""Adam's stage exchanging its update units without the passes around the kernels, bitwise as with them.

The stage compresses ``g / d`` and multiplies the average back by ``d`` (``d``: the frozen denominators). Given
the group's divisor, the quantizers' kernels divide as they load and the average is multiplied as it is finished
(:attr:`gradcomp.exchanges.base.Handle.divisor`): no divided copy of the gradient, no separate product. Each form
is checked against the sequence it replaces, bit for bit.
"""
import pytest
import torch
from test_grad_contract import BASE, CASES, assert_logs_equal

import contract_workers as workers
import gradcomp
import gradcomp.backends
from gradcomp.compressors.per_parameter import PerParameter
from gradcomp.exchanges import average_gathered
from gradcomp.optim import FrozenVarianceAdam

NUMELS = (3000, 10, 5000, 1, 2048, 7, 1500, 1281)  # parts whose last word or chunk is partly used, dense ones
DENSE_BELOW = 1024
BACKENDS = ["torch", pytest.param("numba", marks=pytest.mark.skipif(
    not gradcomp.backends.is_available("numba"), reason="numba is not installed"))]


def _inputs(dtype, seed=0):
    """A group's gradient (``dtype``, with a NaN and an infinity), a divisor and a residual (float32)."""
    generator = torch.Generator().manual_seed(seed)
    n = sum(NUMELS)
    grad = torch.randn(n, generator=generator)
    grad[[5, 4000]] = torch.tensor([float("nan"), float("inf")])
    divisor = torch.rand(n, generator=generator) * 1e-3 + 1e-6
    divisor[3000:3010] = 1.0  # a parameter that is not frozen
    return grad.to(dtype), divisor, torch.randn(n, generator=generator) * 1e-2


def _bits(tensor):
    return tensor.view(torch.int32) if tensor.dtype == torch.float32 else tensor.view(torch.int16)


def _compressed(divided, compress, grad, divisor, residual, residuals):
    """``compress(grad, r_in, r_out, divisor)`` (``divided``) or ``compress(float32(grad) / divisor, r_in, r_out,
    None)`` (the stage's sequence: a divided copy, then the kernel); returns its output and ``r_out``."""
    r_in = None if residuals == "none" else residual.clone()
    r_out = None if residuals == "none" else r_in if residuals == "in place" else torch.zeros_like(residual)
    if divided:
        return compress(grad, r_in, r_out, divisor), r_out
    return compress(grad.float() / divisor, r_in, r_out, None), r_out


def _assert_same(fused, plain):
    (fused, fused_residual), (plain, plain_residual) = fused, plain
    assert torch.equal(fused, plain)
    if fused_residual is not None:  # NaN bits are unspecified (the backends' contract): compare where they are
        assert torch.equal(fused_residual.isnan(), plain_residual.isnan())
        assert torch.equal(_bits(fused_residual.nan_to_num(0.0)), _bits(plain_residual.nan_to_num(0.0)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", ["threebit", "twobit:chunk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("residuals", ["none", "separate", "in place"])
def test_the_batched_compress_divided_is_bitwise_the_compress_of_the_divided_gradient(backend, spec, dtype,
                                                                                    residuals):
    group = PerParameter(gradcomp.from_spec(spec), NUMELS, dense_below=DENSE_BELOW)
    parts, op = group._plan(torch.float32).batched, group.base.part_ops[0]
    words = group.layout(group.numel, torch.float32).nbytes // 4

    def compress(backend):
        def run(grad, r_in, r_out, divisor):
            out = torch.zeros(words, dtype=torch.int32)
            extra = {} if divisor is None else {"divisor": divisor}
            gradcomp.backends.kernel_parts(op, grad.device, backend)(grad, r_in, r_out, out, parts, **extra)
            return out
        return run

    inputs = (*_inputs(dtype), residuals)
    _assert_same(_compressed(True, compress(backend), *inputs), _compressed(False, compress("torch"), *inputs))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("residuals", ["none", "separate", "in place"])
def test_a_group_compressed_divided_is_bitwise_the_group_of_the_divided_gradient(monkeypatch, backend, residuals):
    """Its dense parts too (float32: the stage divides a float32 copy, and a divisor is given for float32 only)."""
    monkeypatch.setenv(gradcomp.backends.ENV_VAR, backend)
    group = PerParameter(gradcomp.from_spec("threebit"), NUMELS, dense_below=DENSE_BELOW)
    assert group.divides

    def compress(grad, r_in, r_out, divisor):
        extra = {} if divisor is None else {"divisor": divisor}
        return group.compress(grad, r_in, r_out, **extra).buffer

    inputs = (*_inputs(torch.float32), residuals)
    _assert_same(_compressed(True, compress, *inputs), _compressed(False, compress, *inputs))


def test_a_divisor_is_refused_where_it_cannot_apply():
    grad, divisor, _ = _inputs(torch.float32)
    with pytest.raises(TypeError, match="no divisor"):
        PerParameter(gradcomp.from_spec("topk:0.1"), NUMELS).compress(grad, divisor=divisor)
    group = PerParameter(gradcomp.from_spec("threebit"), NUMELS)
    with pytest.raises(ValueError, match="divisor"):
        group.compress(grad, divisor=divisor[1:])
    with pytest.raises(TypeError, match="divisor"):
        group.compress(grad, divisor=divisor.double())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_the_average_times_the_multiplier_is_bitwise_the_division_then_the_product(monkeypatch, backend, world_size):
    monkeypatch.setenv(gradcomp.backends.ENV_VAR, backend)
    group = PerParameter(gradcomp.from_spec("threebit"), NUMELS, dense_below=DENSE_BELOW)
    grads = [_inputs(torch.float32, seed=rank)[0] * (1e30 if rank == 1 else 1.0) for rank in range(world_size)]
    payloads = [group.compress(grad) for grad in grads]
    gathered = torch.cat([payload.buffer for payload in payloads])
    layout, multiplier = payloads[0].layout, _inputs(torch.float32)[1]
    multiplier[7] = 0.0
    fused = average_gathered(group, layout, gathered, torch.empty(group.numel), multiplier=multiplier)
    plain = average_gathered(group, layout, gathered, torch.empty(group.numel), backend="torch").mul_(multiplier)
    assert torch.equal(fused.isnan(), plain.isnan()) and int(fused.isnan().sum()) >= 1
    assert torch.equal(_bits(fused.nan_to_num(0.0)), _bits(plain.nan_to_num(0.0)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_recipe_with_its_divisor_is_bitwise_the_recipe_without(monkeypatch, backend):
    """The contract's loop (clip, a learning rate set by hand, accumulation) on two simulated ranks, 2-bit under
    AdamW past the freeze: ``.grad``, the clip's norms and the parameters, with and without the divisor."""
    monkeypatch.setenv(gradcomp.backends.ENV_VAR, backend)
    config = {**BASE, **CASES["adamw-twobit"], "steps": 20}
    given, divisor = [], FrozenVarianceAdam.divisor

    def counted(stage, keys, numels):
        found = divisor(stage, keys, numels)
        given.append(found is not None)
        return found

    monkeypatch.setattr(FrozenVarianceAdam, "divisor", counted)
    fused = workers.simulated(config)
    monkeypatch.setattr(FrozenVarianceAdam, "divisor", None)  # the engine then calls before_compress, after_average
    plain = workers.simulated(config)
    assert sum(given) >= 20, "the fused path never ran"
    for rank in range(2):
        assert_logs_equal(fused[rank], plain[rank], f"rank {rank}")


def _stage(exchange="gradient"):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    spare = torch.nn.Parameter(torch.zeros(4))  # never in the loss: Adam never steps it, it never freezes
    params = [*net.parameters(), spare]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    named = [*net.named_parameters(), ("spare", spare)]
    stage = FrozenVarianceAdam(optimizer, named, freeze_step=3, exchange=exchange)
    for _ in range(3):
        optimizer.zero_grad()
        net(torch.randn(4, 6)).square().sum().backward()
        optimizer.step()
    keys = [name for name, _ in named]
    return net, optimizer, stage, keys, [p.numel() for _, p in named], spare


@pytest.mark.filterwarnings("ignore:gradcomp. freezing Adam")
def test_the_divisor_is_the_frozen_denominators_and_follows_them():
    net, optimizer, stage, keys, numels, spare = _stage()
    divisor = stage.divisor(keys, numels)
    expected = torch.cat([optimizer.state[p]["frozen_denom"].reshape(-1) for p in net.parameters()] + [torch.ones(4)])
    assert torch.equal(divisor, expected)
    assert stage.divisor(keys, numels) is divisor  # kept while the denominators stay
    grad = torch.randn(sum(numels))
    assert torch.equal(stage.before_compress(keys, numels, grad), grad / divisor)
    stage.suspend()
    assert stage.divisor(keys, numels) is None
    optimizer.zero_grad()
    net(torch.randn(4, 6)).square().sum().backward()
    optimizer.step()
    stage.resume()  # frozen again at this step: new denominators
    renewed = stage.divisor(keys, numels)
    assert renewed is not divisor and not torch.equal(renewed, divisor)
    assert torch.equal(renewed[:-4], torch.cat([optimizer.state[p]["frozen_denom"].reshape(-1)
                                                for p in net.parameters()]))
    assert "frozen_denom" not in optimizer.state.get(spare, {})


@pytest.mark.filterwarnings("ignore:gradcomp. freezing Adam")
def test_no_divisor_where_the_stage_does_more_than_divide():
    *_, stage, keys, numels, _ = _stage(exchange="momentum")
    assert stage.divisor(keys, numels) is None
