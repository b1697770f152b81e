"""FrozenVarianceAdam under a sparsifier: each late gradient caught up (gradcomp.optim.catch_up, frozen_update).

In-process, the stage driven as the engine drives it (``after_compress`` names the groups a compressor sent, then
the optimizer's step): a coordinate sent every step takes the frozen step itself, bit for bit; a burst after a wait
lands where the frozen step would have put the same gradients on time; the update against the formula one element
at a time in float64; the waits' life (dense steps, quantizers, suspension, reset) and checkpoints. The recipe's
choice of the stage is in test_recipe.py, its runs on real Gloo ranks in test_recipe.py and test_grad_contract.py.
"""
import pytest
import torch

from gradcomp.compressors import ThreeBit, TopK
from gradcomp.optim import FrozenVarianceAdam

LR = 0.01


def _stage(params, freeze_step=2, weight_decay=0.0, **kwargs):
    optimizer = torch.optim.AdamW([p for _, p in params], lr=LR, weight_decay=weight_decay)
    return FrozenVarianceAdam(optimizer, params, freeze_step=freeze_step, spike_guard=False, live_level=False,
                              **kwargs)


def _dense_start(stage, params, steps=2):
    for step in range(steps):
        for _, p in params:
            p.grad = torch.full_like(p, 0.5 * (step + 1)) + torch.linspace(-1, 1, p.numel()).view(p.shape)
        stage.optimizer.step()


def _send(stage, params, grads, compressor):
    """One compressed step: ``grads`` the averages (one per parameter)."""
    stage.after_compress([n for n, _ in params], None, compressor, 0)
    for (_, p), g in zip(params, grads):
        p.grad = g.clone()
    stage.optimizer.step()


def test_a_coordinate_sent_every_step_takes_the_frozen_step_bit_for_bit():
    """Every coordinate nonzero in every average (each wait 1, c = 1): the caught-up stage steps as the frozen
    step does without the catch-up (a quantizer's group), parameters and first moments bitwise; ``.grad`` is left
    as the loop set it."""
    ours = [("a", torch.nn.Parameter(torch.randn(4, 3))), ("b", torch.nn.Parameter(torch.randn(3)))]
    theirs = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in ours]
    caught_up, plain = _stage(ours, weight_decay=0.1), _stage(theirs, weight_decay=0.1)
    _dense_start(caught_up, ours), _dense_start(plain, theirs)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=gen) for _, p in ours]
        _send(caught_up, ours, grads, TopK(0.01)), _send(plain, theirs, grads, ThreeBit())
        assert all(torch.equal(p.grad, g) for (_, p), g in zip(ours, grads))
        assert set(caught_up.catch_up.waits) == {"a", "b"} and plain.catch_up.waits == {}
        assert all(not bool(w.any()) for w in caught_up.catch_up.waits.values())
    for (_, p), (_, q) in zip(ours, theirs):
        assert torch.equal(p, q)
        assert torch.equal(caught_up.optimizer.state[p]["exp_avg"], plain.optimizer.state[q]["exp_avg"])


@pytest.mark.parametrize("wait", [2, 5, 40])
def test_a_burst_after_a_wait_lands_where_the_frozen_step_would_have_put_the_same_gradients(wait):
    """A coordinate whose average is zero for ``wait - 1`` steps and then ``wait * g`` ends that step at the
    parameter and first moment of a twin whose same coordinate got ``g`` at every step (the same first moment
    carried in; the bias correction at 1, far into a run); the coordinate sent every step beside it is the twin's
    throughout."""
    p = torch.nn.Parameter(torch.tensor([0.3, -0.2]))
    q = torch.nn.Parameter(p.detach().clone())
    ours, twin = _stage([("w", p)]), _stage([("w", q)])
    _dense_start(ours, [("w", p)]), _dense_start(twin, [("w", q)])
    for stage, param in ((ours, p), (twin, q)):
        stage.optimizer.state[param]["step"].fill_(10_000)  # 1 - 0.9^t is 1 in float32
    g = torch.tensor([0.7, -1.3])
    for step in range(1, wait + 1):
        _send(ours, [("w", p)], [torch.stack([g[0], g[1] * wait if step == wait else torch.tensor(0.0)])], TopK(0.01))
        _send(twin, [("w", q)], [g], TopK(0.01))
        if step < wait:
            assert ours.catch_up.waits["w"].tolist() == [0, step]
            torch.testing.assert_close(p[0], q[0])
    assert ours.catch_up.waits["w"].tolist() == [0, 0]
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.optimizer.state[p]["exp_avg"], twin.optimizer.state[q]["exp_avg"],
                               rtol=1e-5, atol=1e-6)


def test_the_update_is_the_formula_per_element():
    """Sparse averages over several steps against the catch-up written one element at a time in float64, weight
    decay and the bias correction included: ``m <- b1 m + (1 - b1) c r``, ``p <- p (1 - lr wd) - lr / bias
    (m + (1 - c) r) / d``, ``c = (1 - b1^a) / ((1 - b1) a)``."""
    p = torch.nn.Parameter(torch.randn(64))
    stage = _stage([("w", p)], weight_decay=0.05)
    _dense_start(stage, [("w", p)])
    state, gen = stage.optimizer.state[p], torch.Generator().manual_seed(1)
    denom = stage._denom(p, stage.optimizer.param_groups[0]).double()
    x, m, a = p.detach().double().clone(), state["exp_avg"].double().clone(), torch.ones(64, dtype=torch.float64)
    for step in range(8):
        r = torch.randn(64, generator=gen) * (torch.rand(64, generator=gen) < 0.3)
        t = int(state["step"]) + 1
        _send(stage, [("w", p)], [r], TopK(0.01))
        c = (1 - 0.9 ** a) / (0.1 * a)
        m = 0.9 * m + 0.1 * c * r.double()
        x = x * (1 - LR * 0.05) - LR / (1 - 0.9 ** t) * (m + (1 - c) * r.double()) / denom
        a = torch.where(r != 0, torch.ones_like(a), a + 1)
        torch.testing.assert_close(p.detach().double(), x, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state["exp_avg"].double(), m, rtol=1e-5, atol=1e-6)


def test_waits_end_with_a_dense_step_a_quantizer_a_suspension_and_a_reset():
    params = [("w", torch.nn.Parameter(torch.randn(8)))]
    stage = _stage(params)
    _dense_start(stage, params)
    sparse = [torch.zeros(8)]
    _send(stage, params, sparse, TopK(0.01))
    assert stage.catch_up.waits["w"].tolist() == [1] * 8
    stage.dense(["w"], [8], torch.zeros(8))  # the schedule's dense step: everything was sent
    params[0][1].grad = torch.zeros(8)
    stage.optimizer.step()
    assert stage.catch_up.waits == {}
    _send(stage, params, sparse, TopK(0.01)), _send(stage, params, sparse, ThreeBit())
    assert stage.catch_up.waits == {}  # a quantizer sends every coordinate
    for leave in (stage.reset, stage.suspend):
        _send(stage, params, sparse, TopK(0.01))
        assert stage.catch_up.waits["w"].tolist() == [1] * 8
        leave()
        assert stage.catch_up.waits == {}


def test_checkpoints_carry_the_waits_and_refuse_bad_ones():
    """The waits round-trip (the resumed stage steps bitwise as the one that went on); a state saved before the
    waits existed loads with none; a wait of another dtype, shape or sign, or of no parameter, is refused before
    anything changes."""
    ours = [("w", torch.nn.Parameter(torch.randn(16)))]
    twin = [("w", torch.nn.Parameter(ours[0][1].detach().clone()))]
    stage, other = _stage(ours), _stage(twin)
    _dense_start(stage, ours), _dense_start(other, twin)
    mask = torch.arange(16) % 3 == 0
    for step in range(4):
        grads = [torch.linspace(-1, 1, 16) * mask.roll(step)]
        _send(stage, ours, grads, TopK(0.01)), _send(other, twin, grads, TopK(0.01))
    saved = stage.state_dict()
    assert saved["waits"]["w"].dtype == torch.int16 and bool(saved["waits"]["w"].any())
    other.catch_up.clear()
    other.load_state_dict(saved)
    grads = [torch.linspace(1, 2, 16) * mask]
    _send(stage, ours, grads, TopK(0.01)), _send(other, twin, grads, TopK(0.01))
    assert torch.equal(ours[0][1], twin[0][1])
    before = {k: v.clone() for k, v in other.catch_up.waits.items()}
    bad = [saved["waits"]["w"].int(), saved["waits"]["w"][:8], -saved["waits"]["w"] - 1]
    for waits in [{"w": w} for w in bad] + [{"v": saved["waits"]["w"]}, ["w"]]:
        with pytest.raises(ValueError, match="wait"):
            other.load_state_dict({**saved, "waits": waits})
        assert all(torch.equal(before[k], v) for k, v in other.catch_up.waits.items())
    older = {k: v for k, v in saved.items() if k != "waits"}
    other.load_state_dict(older)
    assert other.catch_up.waits == {}
