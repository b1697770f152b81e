"""Adam's freeze waits for a warm-up the plan could not see (``gradcomp.optim.freeze_gate``), in one process.

The real-rank cases (the freeze opening at the same step on both ranks, bitwise the simulation, and a
one-file resume saved while it waits) are ``adamw-topk-late-freeze`` in ``test_grad_contract.py``.
"""
import math
import warnings

import pytest
import torch
from test_optim_units import frozen_denominators, small_net

import gradcomp
from gradcomp import recipe
from gradcomp.optim import FrozenVarianceAdam
from gradcomp.schedule import PlannedSchedule, SparsityRamp

WARMUP = 8


def hand_set(step, warmup=WARMUP, peak=1e-2):
    """A loop's own rate: linear warm-up over ``warmup`` steps, then a slow decay."""
    return peak * (step + 1) / warmup if step < warmup else peak * 0.99 ** (step - warmup)


def run(stage_kwargs, steps, lrs=hand_set, schedule_of=None, late_rate=False):
    """Train a small AdamW net ``steps`` steps, its rate set by hand before each (``late_rate``: between
    ``backward()`` and ``optimizer.step()``); returns ``(net, optimizer, stage, what the schedule gave each
    step, notices)``."""
    net = small_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=lrs(0))
    stage = FrozenVarianceAdam(optimizer, net.named_parameters(), **stage_kwargs) if stage_kwargs else None
    schedule = schedule_of(stage) if schedule_of else None
    generator, given = torch.Generator().manual_seed(1), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            if not late_rate:
                set_rate(optimizer, lrs(step))
            if schedule is not None:
                given.append(schedule.compressor_at(step, gradcomp.TopK(0.01)))
            optimizer.zero_grad()
            net(torch.randn(4, 6, generator=generator)).square().sum().backward()
            if late_rate:
                set_rate(optimizer, lrs(step))
            optimizer.step()
    notices = [str(w.message) for w in caught if issubclass(w.category, gradcomp.RecipeNotice)]
    return net, optimizer, stage, given, notices


def set_rate(optimizer, lr):
    for group in optimizer.param_groups:
        group["lr"] = lr


#: The step the gate opens at: the rate rises up to step WARMUP - 1, step WARMUP's is no higher (read at its
#: optimizer step), so step WARMUP + 1 is the first whose exchange may be compressed.
OPENS = WARMUP + 1


@pytest.mark.parametrize("late_rate", [False, True])
def test_the_freeze_waits_for_the_rate_to_stop_rising(late_rate):
    net, optimizer, stage, _, notices = run({"freeze_step": 3, "latest_freeze": 12}, OPENS + 2, late_rate=late_rate)
    assert stage.gate.opened == OPENS and stage.freeze_delay == OPENS - 3
    # Until then the user's AdamW ran untouched: bitwise a plain AdamW on the same rates.
    waited, _, _, _, _ = run({"freeze_step": 3, "latest_freeze": 12}, OPENS, late_rate=late_rate)
    plain, plain_optimizer, _, _, _ = run(None, OPENS)
    assert all(torch.equal(a, b) for a, b in zip(waited.parameters(), plain.parameters()))
    # The denominators are the variance of step OPENS, frozen there.
    torch.testing.assert_close([optimizer.state[p]["frozen_denom"] for p in net.parameters()],
                               frozen_denominators(plain_optimizer, plain, OPENS))
    assert len(notices) == 1 and f"froze at step {OPENS}" in notices[0] and "6 more dense steps" in notices[0]


def test_a_rate_still_rising_at_the_latest_step_freezes_there_and_says_so():
    _, _, stage, _, notices = run({"freeze_step": 3, "latest_freeze": 5}, OPENS)
    assert stage.gate.opened == 5
    assert any("still rising there" in n for n in notices), notices


@pytest.mark.parametrize("lrs", [lambda s: 1e-2, lambda s: 1e-2 * 0.9 ** s])
def test_a_flat_or_falling_rate_freezes_as_planned_bitwise(lrs):
    gated, _, stage, _, notices = run({"freeze_step": 3, "latest_freeze": 12}, 8, lrs)
    planned, _, _, _, _ = run({"freeze_step": 3}, 8, lrs)
    assert stage.gate.opened == 3 and notices == []
    assert all(torch.equal(a, b) for a, b in zip(gated.parameters(), planned.parameters()))


def test_the_planned_schedule_stays_dense_while_the_freeze_waits_then_runs_late():
    inner = SparsityRamp(3, 2, (0.25, 0.125))
    _, _, stage, given, _ = run({"freeze_step": 3, "latest_freeze": 12}, 14,
                                schedule_of=lambda stage: PlannedSchedule(inner, 14, announce=False, gate=stage))
    densities = [None if c is None else c.density for c in given]
    assert densities == [None] * OPENS + [0.25, 0.25, 0.125, 0.125, 0.01]
    # Without a gate the same schedule compresses from step 3.
    assert PlannedSchedule(inner, 14, announce=False).compressor_at(3, gradcomp.TopK(0.01)).density == 0.25


def test_the_gate_is_checkpointed_and_checked():
    _, _, waiting, _, _ = run({"freeze_step": 3, "latest_freeze": 12}, 5)
    saved = waiting.state_dict()
    assert saved["gate"] == {"opened": None, "lr_seen": [hand_set(4)], "rising": True}
    assert saved["latest_freeze"] == 12
    net = small_net()
    other = FrozenVarianceAdam(torch.optim.AdamW(net.parameters()), net.named_parameters(), 3, latest_freeze=12)
    other.load_state_dict(saved)
    assert other.gate.opened is None and other.gate.lr_seen == (hand_set(4),) and other.gate.rising
    for bad in ({"opened": 2}, {"opened": 4.0}, {"opened": None, "lr_seen": ["fast"]},
                {"opened": None, "rising": "yes"}):
        with pytest.raises(ValueError, match="checkpoint"):
            other.load_state_dict({**saved, "gate": bad})
    assert other.gate.lr_seen == (hand_set(4),)
    with pytest.raises(ValueError, match="latest_freeze"):
        other.load_state_dict({**saved, "latest_freeze": None})
    # Saved before the gate existed: a gated stage decides afresh, a planned one freezes at freeze_step.
    older = {k: v for k, v in saved.items() if k not in ("gate", "latest_freeze")}
    other.load_state_dict({**older, "latest_freeze": 12})
    assert other.gate.opened is None
    planned = FrozenVarianceAdam(torch.optim.AdamW(net.parameters()), net.named_parameters(), 3)
    planned.load_state_dict(older)
    assert planned.gate.opened == 3


def test_the_recipe_gates_the_freeze_only_where_no_scheduler_shows_the_warm_up():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 256))
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        by_hand = recipe.plan("twobit", optimizer, total_steps=1000, named_parameters=named, announce=False)
        assert by_hand.transform.gate.latest == math.ceil(recipe.ADAM_DENSE_FRACTION * 1000) > by_hand.dense_steps
        assert "later while the learning rate rises, up to step 100" in by_hand.summary
        assert by_hand.schedule.gate is by_hand.transform
        cost = by_hand.transform.gate.cost
        # The dense start's fp16 casts leave room under the budget; a freeze 30 steps late is paid back by the
        # ternary code over the last steps, one 90 steps late is more than its saving over the rest can pay back.
        assert "8.5x" in cost(0) and "8.0x" in cost(30) and "in TwoBit" in cost(30) and "under" not in cost(30)
        assert "in TwoBit" not in cost(10) and "under the 8x asked" in cost(90)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
        planned = recipe.plan("twobit", optimizer, total_steps=1000, scheduler=scheduler, named_parameters=named,
                              announce=False)
        assert planned.transform.gate.latest is None and planned.transform.gate.opened == planned.dense_steps
        sgd = recipe.plan("twobit", torch.optim.SGD(model.parameters(), lr=0.1), total_steps=1000,
                          named_parameters=named, announce=False)
        assert sgd.schedule.gate is None


#: The late-freeze run: steps, the hand-set warm-up, its peak rate (a 165K-parameter net under the recipe's 2-bit).
LATE_STEPS, LATE_WARMUP, LATE_PEAK = 600, 24, 1e-3


def late_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.Tanh(), torch.nn.Linear(256, 128))


def late_batches(generator, world_size=2):
    """One step's input of every rank ``[8, 512]``, drawn in rank order from ``generator`` (every rank draws all)."""
    return [torch.randn(8, 512, generator=generator) for _ in range(world_size)]


def late_loss(replica, x):
    return replica(x).square().mean()


def simulate_late_freeze(replan=True):
    """The late-freeze run on two simulated ranks (the engine's own exchange); returns ``(rank 0's engine, the
    schedule each step used, rank 0's parameters)``. ``replan=False``: the plan after the late freeze only
    shifted, as before it kept the budget. ``recipe_horovod_worker`` runs the same through Horovod."""
    from experiments.simulate import Simulation
    from gradcomp.engine import Engine
    from gradcomp.setup import prepare

    def attach(rank, replica, optimizer, transport):
        setup = prepare("twobit", replica.named_parameters(), optimizer=optimizer, total_steps=LATE_STEPS,
                        announce=False)
        if not replan:
            setup.settings["schedule"].replan = None
        return Engine(setup.compressor, transport, **setup.settings)

    sim = Simulation(late_model(), lambda m: torch.optim.AdamW(m.parameters()), attach, world_size=2)
    generator, used = torch.Generator().manual_seed(2), []
    for step in range(LATE_STEPS):
        for optimizer in sim.optimizers:
            set_rate(optimizer, hand_set(step, LATE_WARMUP, LATE_PEAK))
        sim.zero_grad()
        used.append(sim.engines[0].compressor_now())  # this step's, asked where its exchange asks (after the last step)
        sim.backward([(x,) for x in late_batches(generator)], late_loss)
        sim.step()
    return sim.engines[0], used, [p.detach().clone() for p in sim.replicas[0].parameters()]


def test_a_late_freeze_keeps_the_byte_budget_as_the_engine_counts_it():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, used, _ = simulate_late_freeze()
    stage, totals = engine.transform, engine.telemetry.stats()["total"]
    assert isinstance(engine.compressor, gradcomp.ThreeBit) and stage.gate.opened == 25 and stage.freeze_delay == 15
    # The 15 extra steps of the dense start (fp16 casts after DDP's first two) are paid back by the ternary code
    # over the run's last steps.
    kinds = [type(c).__name__ if c is not None else None for c in used]
    switch = kinds.index("TwoBit")
    assert kinds == [None] * 2 + ["FP16"] * 23 + ["ThreeBit"] * (switch - 25) + ["TwoBit"] * (600 - switch)
    assert 500 < switch < 600
    assert totals["dense_bytes"] / totals["bytes_sent"] >= 8.0
    notices = [str(w.message) for w in caught if issubclass(w.category, gradcomp.RecipeNotice)]
    assert any(f"its last {600 - switch} steps in TwoBit" in n and "under" not in n for n in notices), notices
    # Only shifted, the same run sends more than the budget: the replan is what keeps it.
    shifted, used, _ = simulate_late_freeze(replan=False)
    shifted_totals = shifted.telemetry.stats()["total"]
    assert all(type(c).__name__ == "ThreeBit" for c in used[25:])
    assert shifted_totals["dense_bytes"] / shifted_totals["bytes_sent"] < 7.99
