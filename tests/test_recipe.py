"""The one-call recipe: constants derived from the run, the same result as the pieces assembled by
hand, bitwise resume across the freeze and mid-ramp, and clear errors (real Gloo ranks)."""
import warnings

import pytest
import torch

import gradcomp
import multiprocess
import recipe_workers as workers
from gradcomp.optim import DelayedMomentumSGD, FrozenVarianceAdam
from gradcomp.recipe import lr_peak_step, plan
from gradcomp.schedule import DenseWarmup, SparsityRamp
from gradcomp.setup import RecipeNotice

# The rules of gradcomp.recipe worked out by hand for the workers' run: 40 steps, the LR peaks at
# step 5 (> 5% of 40), so 5 dense steps; top-k 1% runs as compact entries at 2% (the same bytes) and
# ramps from the densest start the 2x budget affords over the shortest ramp (1/4), halving down to
# 1/32, each stage as long as the budget allows but at most 3/4 of the 35 remaining steps in all (6
# each). The same under SGD. 2-bit runs as ThreeBit() after the dense start under SGD and AdamW.
RAMP = (5, 6, (0.25, 0.125, 0.0625, 0.03125))
DENSE_ONLY = (5, None, ())
CASES = [("sgd", "topk:0.01", RAMP), ("sgd", "twobit:rms", DENSE_ONLY), ("adamw", "topk:0.01", RAMP),
         ("adamw", "twobit:rms", DENSE_ONLY)]


def spawn(worker, out_dir, *args):
    out_dir.mkdir()
    return multiprocess.spawn(worker, 2, str(out_dir), *args)


def assert_params_equal(a, b, what):
    for name, value in a["params"].items():
        assert torch.equal(b["params"][name], value), f"{what}: {name} differs"


# Every test on real ranks here is slow (the quick run keeps the plan's in-process tests; test_amp runs the
# recipe on 2 real ranks).
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("kind,spec,hand", CASES, ids=[f"{k}-{s}" for k, s, _ in CASES])
def test_recipe_equals_the_hand_assembled_pieces_and_replicas_agree(tmp_path, kind, spec, hand):
    recipe = spawn(workers.train_worker, tmp_path / "recipe", kind, spec, "recipe")
    by_hand = spawn(workers.train_worker, tmp_path / "hand", kind, spec, "hand", hand)
    assert_params_equal(recipe[0], recipe[1], "replicas")
    assert_params_equal(recipe[0], by_hand[0], "recipe vs hand-assembled")
    chosen = recipe[0]["recipe"]
    assert chosen["dense_steps"] == hand[0]
    if hand[2]:
        assert chosen["schedule"]["stage_steps"] == hand[1]
        assert tuple(chosen["schedule"]["densities"]) == hand[2]
    assert recipe[0]["stats"]["compression_ratio"] > 1.5  # compression really ran
    if kind == "sgd":
        assert recipe[0]["momentum"] == [0.9]  # SGD keeps its momentum


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("kind,spec,split", [("adamw", "topk:0.01", 3), ("adamw", "twobit:rms", 12),
                                             ("sgd", "topk:0.01", 4)],
                         ids=["adamw-before-freeze", "adamw-after-freeze", "sgd-mid-ramp"])
def test_recipe_resumes_bitwise(tmp_path, kind, spec, split):
    whole = spawn(workers.train_worker, tmp_path / "whole", kind, spec, "recipe")
    resumed = spawn(workers.resume_worker, tmp_path / "resumed", kind, spec, split)
    assert resumed[0]["step"] == whole[0]["step"] == workers.TOTAL_STEPS
    assert_params_equal(whole[0], resumed[0], f"resumed at step {split}")
    assert_params_equal(resumed[0], resumed[1], "replicas after the resume")


# -- the plan, without processes ------------------------------------------------------------------
def named_mlp():
    """Parameters with tensors of a small model's size (a payload's alignment and top-k's rounding up
    are then a few bytes in 10^5, as on real models; :func:`test_bytes_are_counted_from_the_payloads`
    takes the workers' tiny model, where they are not)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    return list(model.named_parameters())


def test_dense_start_follows_the_lr_warm_up_or_five_percent():
    named = named_mlp()
    optimizer = torch.optim.SGD([p for _, p in named], lr=0.1)
    warm = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 101))
    assert lr_peak_step(warm, 2000) == 100
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 101)  # the probe changed nothing
    assert plan("topk:0.01", None, 2000, warm, named, min_numel=0).dense_steps == 100
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=2000)
    assert plan("topk:0.01", None, 2000, cosine, named, min_numel=0).dense_steps == 100  # no warm-up: 5%
    assert plan("topk:0.01", None, 600, None, named, min_numel=0).dense_steps == 30
    # 2-bit's code costs 1/16 + 1/64 of dense: an 8x budget affords a dense start of 5%, a 10x budget
    # 2000 * (1/10 - 0.078125) / (1 - 0.078125) = 47 steps.
    assert plan("twobit:chunk", None, 2000, cosine, named, min_numel=0).dense_steps == 100
    assert plan("twobit:chunk", None, 2000, cosine, named, min_numel=0, min_compression=10).dense_steps == 47
    assert plan("twobit:chunk", None, 10, None, named).dense_steps == 2  # DDP's bucket rebuild at least


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_a_scheduler_that_steps_on_a_metric_plans_as_a_rate_set_by_hand(kind):
    """ReduceLROnPlateau's step() needs the loop's metric: the plan cannot read it ahead and reads the rate as the
    run goes, as with no scheduler (its step() called without a metric raised a TypeError at register)."""
    named = named_mlp()
    params = [p for _, p in named]
    make = (lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9)) if kind == "sgd" else \
        (lambda: torch.optim.AdamW(params, lr=1e-3))
    optimizer = make()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    for spec in ("topk:0.01", "twobit:chunk"):
        planned, unscheduled = (plan(spec, optimizer, 600, s, named, announce=False) for s in (plateau, None))
        assert planned.dense_steps == unscheduled.dense_steps
        assert planned.summary == unscheduled.summary
    assert optimizer.param_groups[0]["lr"] == (0.1 if kind == "sgd" else 1e-3)
    # as the HF Trainer's and Accelerate's integrations hand it over: a view that steps it once per optimizer step
    from gradcomp.hooks.accelerate import OptimizerStepScheduler
    from gradcomp.lr_schedule import plannable

    assert plannable(OptimizerStepScheduler(plateau, optimizer)) is None
    stepped = OptimizerStepScheduler(torch.optim.lr_scheduler.LinearLR(optimizer), optimizer)
    assert plannable(stepped) is stepped


@pytest.mark.parametrize("kind", ["lambda", "onecycle", "linear", "sequential"])
def test_a_resumed_schedulers_warm_up_is_read_from_the_runs_first_step(kind):
    """A resumed run loads its scheduler's state, then registers: the plan must be the one its checkpoint was saved
    under (the schedule's settings are checked at load). A scheduler whose rate is a function of the step is
    rewound; one that cannot be (SequentialLR) is planned from where it is, as before."""
    param = torch.nn.Parameter(torch.zeros(3))

    def make():
        optimizer = torch.optim.SGD([param], lr=0.1)
        lr = torch.optim.lr_scheduler
        return optimizer, {
            "lambda": lambda: lr.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100)),
            "onecycle": lambda: lr.OneCycleLR(optimizer, max_lr=0.1, total_steps=1000),
            "linear": lambda: lr.LinearLR(optimizer, 0.01, total_iters=100),
            "sequential": lambda: lr.SequentialLR(optimizer, [lr.LinearLR(optimizer, 0.01, total_iters=100),
                                                              lr.CosineAnnealingLR(optimizer, 900)], milestones=[100]),
        }[kind]()

    optimizer, scheduler = make()
    fresh = lr_peak_step(scheduler, 1000)
    assert fresh in (99, 100, 299)
    for _ in range(300):
        optimizer.step()
        scheduler.step()
    live = (optimizer.param_groups[0]["lr"], scheduler.state_dict())
    resumed = lr_peak_step(scheduler, 1000)
    assert resumed == (0 if kind == "sequential" else fresh)
    assert (optimizer.param_groups[0]["lr"], scheduler.state_dict()) == live  # the probe changed nothing
    again, reloaded = make()  # a new process: the optimizer's state and the scheduler's loaded
    again.load_state_dict(optimizer.state_dict())
    reloaded.load_state_dict(scheduler.state_dict())
    assert lr_peak_step(reloaded, 1000) == resumed


def test_under_adam_the_dense_start_asks_ten_percent_for_the_variance_and_the_budget_caps_it():
    """Adam's dense start is also its variance's window before the freeze: 10% of a 2000-step run where the
    budget allows (a 4x budget), what top-k's 8x budget leaves once its ramp has its shortest length
    (174 steps, more than SGD's 5%), and 3-bit's 1.9% under either optimizer."""
    named = named_mlp()
    params = [p for _, p in named]
    adam, sgd = torch.optim.AdamW(params, lr=1e-3), torch.optim.SGD(params, lr=0.1, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecipeNotice)
        steps = {(type(o).__name__, spec, budget): plan(spec, o, 2000, None, named, min_numel=0,
                                                         min_compression=budget).dense_steps
                 for o in (adam, sgd) for spec in ("topk:0.01", "twobit") for budget in (None, 4)}
    assert steps["AdamW", "topk:0.01", 4] == steps["AdamW", "twobit", 4] == 200
    assert steps["SGD", "topk:0.01", 4] == steps["SGD", "topk:0.01", None] == steps["SGD", "twobit", 4] == 100
    assert 100 < steps["AdamW", "topk:0.01", None] < 200
    assert steps["AdamW", "twobit", None] == steps["SGD", "twobit", None] < 100


@pytest.mark.parametrize("total", [600, 2000, 10000])
@pytest.mark.parametrize("density", [0.01, 0.001])
def test_top_k_ramp_scales_with_the_run_and_keeps_the_byte_budget(total, density):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*under the")  # the budget must be met without a notice
        chosen = plan(f"topk:{density}", None, total, None, named_mlp(), min_numel=0)
    schedule = chosen.schedule.inner  # the recipe's ramp inside its PlannedSchedule
    assert isinstance(schedule, SparsityRamp)
    assert chosen.compressor.compact and chosen.compressor.density == 2 * density  # twice the entries, 4 bytes each
    assert schedule.densities[0] in (1 / 4, 1 / 8, 1 / 16) and all(d > 2 * density for d in schedule.densities)
    assert schedule.stage_steps * len(schedule.densities) <= 0.75 * (total - chosen.dense_steps)
    # Bytes over the run, counted step by step from the schedule itself: at least 8x fewer than dense.
    named = named_mlp()
    sent = sum(sent_share(chosen.schedule.compressor_at(step, chosen.compressor), named) for step in range(total))
    assert total / sent >= 8.0
    assert chosen.expected_compression == pytest.approx(total / sent, rel=1e-6)
    # twice the entries at 4 bytes each: wide top-k's 8 bytes at ``density``, to the payloads' rounding up
    assert sent_share(chosen.compressor, named) == pytest.approx(2 * density, rel=0.03)


def sent_share(compressor, named) -> float:
    """The bytes one step sends for ``named`` under ``compressor`` (``None``: dense; the dense start's fp16
    cast at its payload's bytes) over dense float32's."""
    if compressor is None:
        return 1.0
    return sum(compressor.layout(p.numel(), torch.float32).nbytes for _, p in named) / sum(4 * p.numel()
                                                                                            for _, p in named)


@pytest.mark.parametrize("spec", ["topk:0.01", "twobit:chunk", "threebit"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_bytes_are_counted_from_the_payloads(spec, kind):
    """The workers' tiny model (tensors of 8-64 elements): top-k's entries rounded up, compact entries'
    count per chunk and each segment's 8-byte alignment are most of a payload there, and the plan, counted
    step by step from its schedule and the payloads' layouts, still keeps the 8x budget or says it misses."""
    model = workers.make_model()
    named, optimizer = list(model.named_parameters()), workers.make_optimizer(kind, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chosen = plan(spec, optimizer, 2000, None, named, min_numel=0)
    sent = sum(sent_share(chosen.schedule.compressor_at(step, chosen.compressor), named) for step in range(2000))
    assert chosen.expected_compression == pytest.approx(2000 / sent, rel=1e-6)
    assert 2000 / sent >= 8.0 or any("under the 8x asked" in note for note in chosen.notes)


def test_a_short_run_leaves_the_ramp_its_bytes_after_the_dense_start():
    """200 steps with a 20-step warm-up (the main job's run): the dense start stops where the ramp from
    its sparsest start (1/16) still has its shortest length, and the whole run keeps the 8x budget. By
    hand, in dense steps, top-k 1% running as compact entries at 2% (0.02 of dense's bytes): 19 dense
    steps leave 25 - 19 - 181 * 0.02 = 2.38 for the ramp, 44 steps of its two stages at 0.0425 +
    0.01125 each, over the shortest 0.4 * 181 / 2 = 36; 20 would leave 1.4, 26 steps < 36. The
    warm-up ends at step 19, so the whole of it runs dense (with 8-byte entries only 17 steps of it
    did)."""
    named = named_mlp()
    optimizer = torch.optim.AdamW([p for _, p in named], lr=1e-3)
    warm = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*warm-up ends")  # the budget affords the warm-up
        chosen = plan("topk:0.01", None, 200, warm, named, min_numel=0)
    assert chosen.dense_steps == 19 and chosen.expected_compression >= 8.0 * 0.999
    schedule = chosen.schedule.inner
    assert schedule.densities == (1 / 16, 1 / 32) and schedule.stage_steps == 44


def test_a_warm_up_longer_than_the_budget_affords_is_cut_short_and_said():
    """The byte budget is the user's promise: a 300-step warm-up of a 1000-step run would leave 3.1x
    fewer bytes with 2-bit, so compression starts at the 50 dense steps the 8x budget affords."""
    named = named_mlp()
    optimizer = torch.optim.SGD([p for _, p in named], lr=0.1)
    long_warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 301))
    with pytest.warns(RecipeNotice, match="warm-up ends at step 300, but the byte budget affords 50"):
        chosen = plan("twobit:chunk", None, 1000, long_warmup, named, min_numel=0)
    assert chosen.dense_steps == 50 and chosen.expected_compression >= 8.0 * 0.999
    tight = plan("twobit:chunk", None, 1000, long_warmup, named, min_numel=0, min_compression=20)
    assert tight.dense_steps == 2 and any("under the 20x asked" in note for note in tight.notes)


def test_optimizer_stages_by_optimizer():
    named = named_mlp()
    params = [p for _, p in named]
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4, nesterov=True)
    chosen = plan("topk:0.01", sgd, 1000, None, named)
    # top-k under SGD-momentum: the stage catches up each coordinate's late gradient; the groups stay the user's
    assert isinstance(chosen.transform, DelayedMomentumSGD) and sgd.param_groups[0]["momentum"] == 0.9
    assert "each coordinate's late gradient caught up as the momentum would have applied it" in chosen.summary
    assert plan("topk:0.01", sgd, 1000, None, named, sharded=True).transform is None  # FSDP: not run there yet
    assert plan("topk:0.01", torch.optim.SGD(params, lr=0.1), 1000, None, named).transform is None  # no momentum
    with pytest.warns(RecipeNotice, match="under SGD 2-bit runs as ThreeBit"):
        seven = plan("twobit:chunk", sgd, 1000, None, named, min_numel=0)
    assert seven.compressor.spec == "threebit" and seven.transform is None
    assert seven.expected_compression >= 8.0 * 0.999  # the same budget as 2-bit's
    adam = torch.optim.Adam(params, lr=1e-3)
    with pytest.warns(RecipeNotice, match="under Adam 2-bit runs as ThreeBit"):
        assert plan("twobit:rms", adam, 1000, None, named).compressor.spec == "threebit"
    with pytest.warns(RecipeNotice, match="runs as TwoBit\\('chunk'\\)"):  # no stage: the chunk code
        assert plan("twobit:rms", torch.optim.Adagrad(params), 1000, None, named).compressor.spec == "twobit:chunk"
    quantized = plan("twobit:chunk", adam, 1000, None, named)
    assert isinstance(quantized.transform, FrozenVarianceAdam) and quantized.transform.exchange == "gradient"
    assert quantized.transform.freeze_step == quantized.dense_steps
    adamw = torch.optim.AdamW(params, lr=1e-3)
    sparse = plan("topk:0.01", adamw, 1000, None, named)
    assert sparse.transform.exchange == "gradient" and sparse.transform.guard is None  # caught up
    assert "each coordinate's late gradient caught up as the first moment would have taken it" in sparse.summary
    assert quantized.transform.guard is not None and "caught up" not in quantized.summary
    with pytest.warns(RecipeNotice, match="Adagrad has no optimizer-aware stage"):
        assert plan("topk:0.01", torch.optim.Adagrad(params), 1000, None, named).transform is None
    with pytest.raises(ValueError, match="total_steps"):
        plan("topk:0.01", adam, None, None, named)
    with pytest.raises(ValueError, match="amsgrad"):
        FrozenVarianceAdam(torch.optim.Adam(params, amsgrad=True), named, freeze_step=5)


def test_under_adam_a_run_too_short_for_3_bits_dense_start_keeps_the_ternary_code():
    """3-bit's payload leaves a 200-step run 2 dense steps at 8x: Adam's variance would freeze on 2
    gradients, so the ternary code, whose budget leaves more, runs; SGD (no variance) keeps 3-bit.
    :func:`gradcomp.recipe.code` decides without touching the optimizer."""
    from gradcomp.optim.adam_settings import MIN_STEADY_FREEZE
    from gradcomp.recipe import code

    named = named_mlp()
    params = [p for _, p in named]
    adam = torch.optim.AdamW(params, lr=1e-3)
    with pytest.warns(RecipeNotice, match="not ThreeBit\\(\\): .* dense steps of this 200-step run"):
        short = plan("twobit:chunk", adam, 200, None, named, min_numel=0)
    assert short.compressor.spec == "twobit:chunk" and short.dense_steps >= MIN_STEADY_FREEZE
    assert short.transform.freeze_step == short.dense_steps
    assert plan("twobit:chunk", adam, 2000, None, named, min_numel=0).compressor.spec == "threebit"
    assert plan("twobit:chunk", torch.optim.SGD(params, lr=0.1), 200, None, named, min_numel=0).compressor.spec \
        == "threebit"
    fresh = torch.optim.AdamW(params, lr=1e-3)
    assert code(gradcomp.TwoBit("chunk"), fresh, 2000).spec == "threebit"
    assert code(gradcomp.TwoBit("chunk"), fresh, 200).spec == "twobit:chunk"
    assert code(gradcomp.TopK(0.01), fresh, 200).spec == "topk:0.02,entries=compact"  # the same bytes
    assert code(gradcomp.TopK(0.6), fresh, 200).spec == "topk:0.6"  # no twice as dense to go to
    assert not fresh._optimizer_step_pre_hooks and not fresh.state  # no stage was built


def test_top_k_under_sgd_selects_over_the_whole_group_and_an_explicit_choice_wins():
    """In gradient units the group's own top-k is the largest first-order decrease; under Adam (update
    units) and for quantizers the engine's per-parameter default stays. A user's granularity is kept."""
    from gradcomp.setup import prepare

    named = named_mlp()
    params = [p for _, p in named]
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    chosen = plan("topk:0.01", sgd, 1000, None, named)
    assert chosen.granularity == "bucket" and "over the whole group" in chosen.summary
    assert prepare("topk:0.01", named, optimizer=sgd, total_steps=1000).settings["granularity"] == "bucket"
    kept = prepare("topk:0.01", named, optimizer=sgd, total_steps=1000, granularity="parameter")
    assert kept.settings["granularity"] == "parameter"
    with pytest.warns(RecipeNotice):
        assert plan("twobit:chunk", sgd, 1000, None, named).granularity is None
    adamw = torch.optim.AdamW(params, lr=1e-3)
    assert "granularity" not in prepare("topk:0.01", named, optimizer=adamw, total_steps=1000).settings


def test_3_bit_under_sgd_decays_its_residuals_and_nothing_else_does():
    """The recipe's 3-bit under SGD (with or without momentum) multiplies each committed residual by
    RESIDUAL_DECAY; under Adam, for top-k and for the ternary code error feedback stays plain. The
    engine of every integration gets it through prepare; a user's own decay is kept."""
    from gradcomp.recipe import RESIDUAL_DECAY
    from gradcomp.setup import prepare

    named = named_mlp()
    params = [p for _, p in named]
    for sgd in (torch.optim.SGD(params, lr=0.1, momentum=0.9), torch.optim.SGD(params, lr=0.1)):
        with pytest.warns(RecipeNotice, match="residuals decayed 0.9 a step"):
            chosen = plan("twobit:chunk", sgd, 1000, None, named)
        assert chosen.compressor.spec == "threebit" and chosen.residual_decay == RESIDUAL_DECAY == 0.9
        with pytest.warns(RecipeNotice):
            assert prepare("twobit", named, optimizer=sgd, total_steps=1000).settings["residual_decay"] == 0.9
            own = prepare("twobit", named, optimizer=sgd, total_steps=1000, residual_decay=0.5)
        assert own.settings["residual_decay"] == 0.5
        assert plan("topk:0.01", sgd, 1000, None, named).residual_decay == 1.0
    adamw = torch.optim.AdamW(params, lr=1e-3)
    with pytest.warns(RecipeNotice):
        assert plan("twobit:chunk", adamw, 2000, None, named).residual_decay == 1.0
        assert "residual_decay" not in prepare("twobit", named, optimizer=adamw, total_steps=2000).settings
    with pytest.warns(RecipeNotice):
        assert plan("twobit:chunk", torch.optim.RMSprop(params), 1000, None, named).residual_decay == 1.0


def test_a_policy_under_the_recipe_picks_the_recipes_own_2_bit_code():
    """Auto's "twobit:chunk" becomes the code the recipe chose for the run (3-bit under SGD, whose
    residual decay the engine holds for that class only), its "topk:0.01" the recipe's compact top-k at
    twice the density; with a top-k recipe that is the recipe's own compressor."""
    from gradcomp.setup import prepare

    named = named_mlp()
    params = [p for _, p in named]
    for optimizer, steps in ((torch.optim.SGD(params, lr=0.1, momentum=0.9), 1000),
                             (torch.optim.AdamW(params, lr=1e-3), 200)):
        with pytest.warns(RecipeNotice):
            setup = prepare("twobit", named, optimizer=optimizer, total_steps=steps, policy=gradcomp.Auto())
        candidates = setup.settings["policy"].candidates
        codes = [c for c in candidates if isinstance(c, (gradcomp.TwoBit, gradcomp.ThreeBit))]
        assert len(codes) == 1 and codes[0] is setup.compressor, candidates
        assert sorted(c.spec for c in candidates if c not in codes) == ["fp16", "topk:0.02,entries=compact"]
        if isinstance(optimizer, torch.optim.SGD):
            assert setup.compressor.spec == "threebit" and setup.settings["residual_decay"] == 0.9
    with pytest.warns(RecipeNotice):
        setup = prepare("topk:0.01", named, optimizer=torch.optim.SGD(params, lr=0.1, momentum=0.9),
                        total_steps=1000, policy=gradcomp.Auto())
    candidates = setup.settings["policy"].candidates
    assert [c.spec for c in candidates] == ["fp16", "twobit:chunk", "topk:0.02,entries=compact"]
    assert candidates[-1] is setup.compressor


def test_adams_dense_start_goes_as_an_fp16_cast_after_ddps_first_two_steps():
    """Under Adam, DDP's first two steps dense (its buckets rebuilt on exact gradients), the dense start's later
    steps an fp16 cast, the plan's steps after it unchanged; the bytes counted at the cast's. Not under SGD, not
    where a policy times dense steps, not under FSDP, not with ``cast_start=False``."""
    from gradcomp.setup import prepare

    named = named_mlp()
    params = [p for _, p in named]
    for spec in ("topk:0.01", "twobit"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecipeNotice)
            sgd = plan(spec, torch.optim.SGD(params, lr=0.1, momentum=0.9), 1000, None, named, min_numel=0)
        assert sgd.dense_steps > 2 and "FP16" not in sgd.summary
        assert all(sgd.schedule.compressor_at(s, sgd.compressor) is None for s in range(sgd.dense_steps))
    for optimizer in (torch.optim.AdamW(params, lr=1e-3), torch.optim.Adam(params, lr=1e-3)):
        for spec in ("topk:0.01", "twobit"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RecipeNotice)
                cast = plan(spec, optimizer, 1000, None, named, min_numel=0)
                dense = plan(spec, optimizer, 1000, None, named, min_numel=0, cast_start=False)
                sharded = plan(spec, optimizer, 1000, None, named, min_numel=0, sharded=True)
            steps = range(cast.dense_steps + 50)
            used = [cast.schedule.compressor_at(s, cast.compressor) for s in steps]
            planned = [dense.schedule.compressor_at(s, dense.compressor) for s in steps]
            assert cast.dense_steps == dense.dense_steps > 2 and "(FP16() from step 2)" in cast.summary
            assert used[:2] == [None, None] and all(isinstance(c, gradcomp.FP16) for c in used[2:cast.dense_steps])
            assert [c.spec for c in used[cast.dense_steps:]] == [c.spec for c in planned[dense.dense_steps:]]
            assert planned[:dense.dense_steps] == [None] * dense.dense_steps
            assert [sharded.schedule.compressor_at(s, sharded.compressor) for s in range(3)] == [None] * 3
            half = (cast.dense_steps - 2) * 0.5  # dense steps' worth of bytes the casts save
            assert 1000 / cast.expected_compression == pytest.approx(1000 / dense.expected_compression - half)
    with pytest.warns(RecipeNotice):
        setup = prepare("topk:0.01", named, optimizer=torch.optim.AdamW(params, lr=1e-3), total_steps=1000,
                        policy=gradcomp.Auto())
    assert setup.settings["schedule"].start is None and setup.settings["schedule"].compressor_at(5, None) is None


def test_stages_take_the_names_of_the_wrapped_or_the_unwrapped_model():
    named = named_mlp()
    for prefix in ("module.", "_orig_mod.", "module._orig_mod."):
        wrapped = [(f"{prefix}{name}", p) for name, p in named]
        stage = FrozenVarianceAdam(torch.optim.AdamW([p for _, p in named]), wrapped, freeze_step=30)
        assert stage.parameter_names() == {name for name, _ in named}, prefix


def test_a_run_past_its_plan_says_so_once_and_keeps_the_final_setting():
    chosen = plan("topk:0.01", None, 100, None, named_mlp(), min_numel=0, announce=True)
    final = chosen.schedule.compressor_at(99, chosen.compressor)
    with pytest.warns(RecipeNotice, match="past the total_steps=100"):
        assert chosen.schedule.compressor_at(100, chosen.compressor) is final
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecipeNotice)
        chosen.schedule.compressor_at(150, chosen.compressor)  # said once


SHORT_RUN = """
import sys, torch
from gradcomp.recipe import plan
torch.manual_seed(0)
named = list(torch.nn.Linear(512, 512).named_parameters())
chosen = plan("topk:0.01", None, 100, None, named, min_numel=0, announce=True)
for step in range(int(sys.argv[1])):
    chosen.schedule.compressor_at(step, chosen.compressor)
"""


@pytest.mark.parametrize("steps, said", [(10, True), (49, True), (50, False), (100, False)])
def test_a_run_ended_before_half_its_plan_says_so_at_exit(steps, said):
    """At interpreter exit, a run whose furthest step is short of half its ``total_steps`` says so once (its
    dense start and ramp were sized for the whole run); a run that got that far does not."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SHORT_RUN, str(steps)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    message = f"the run ended after {steps} of the 100 steps its recipe was planned for"
    assert (message in done.stderr) == said, done.stderr
    assert done.stderr.count("RecipeNotice: gradcomp: the run ended after") == int(said)  # once


@pytest.mark.multiprocess
@pytest.mark.slow
def test_register_rejects_a_stage_that_does_not_know_the_models_names(tmp_path):
    results = multiprocess.spawn(_register_with_foreign_stage, 2, str(tmp_path))
    assert all("was built for other parameters" in r for r in results)


def _register_with_foreign_stage(rank, world_size):
    model = workers.make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    other = [(f"other.{name}", p) for name, p in model.named_parameters()]
    try:
        from gradcomp.hooks import ddp as gc_ddp

        optimizer = torch.optim.AdamW(model.parameters())
        stage = FrozenVarianceAdam(optimizer, other, freeze_step=10)
        stage.names = {name: p for name, p in other}  # a stage built for another model's names
        gc_ddp.register(ddp, gradcomp.TopK(0.01), transform=stage, schedule=DenseWarmup(10))
    except ValueError as error:
        return str(error)
    return "registered"


def test_an_early_freeze_is_warned_about():
    named = named_mlp()
    with pytest.warns(UserWarning, match="freezing Adam's variance after 2 steps"):
        FrozenVarianceAdam(torch.optim.AdamW([p for _, p in named]), named, freeze_step=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FrozenVarianceAdam(torch.optim.AdamW([p for _, p in named]), named, freeze_step=100)


@pytest.mark.horovod
@pytest.mark.multiprocess
@pytest.mark.slow
def test_ddp_and_horovod_give_the_same_result_for_the_same_settings(tmp_path):
    """The recipe through Horovod's drop-in optimizer (its default groups: DDP's buckets, here one) and through
    DDP exchange the same bytes, so they train to the same weights."""
    from pathlib import Path

    from test_horovod import HOROVOD_ERROR

    import recipe_horovod_worker as hvd_worker

    if HOROVOD_ERROR is not None:
        pytest.fail(f"Horovod is not importable ({HOROVOD_ERROR}); build it with scripts/build_horovod.sh")
    out = tmp_path / "horovod"
    out.mkdir()
    multiprocess.horovodrun(Path(hvd_worker.__file__), [str(out)], 2)
    horovod = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for kind, spec in hvd_worker.CASES:
        ddp = spawn(workers.train_worker, tmp_path / f"ddp-{kind}-{spec.replace(':', '_')}", kind, spec, "recipe")
        hv = horovod[0][f"{kind}-{spec}"]
        assert hv["dense_steps"] == ddp[0]["recipe"]["dense_steps"]
        assert hv["residual_decay"] == (0.9 if (kind, spec) == ("sgd", "twobit:rms") else 1.0)  # 3-bit under SGD
        # The same payloads but for alignment padding (a bucket pads each parameter's part to 8 bytes).
        assert hv["stats"]["bytes_sent"] == pytest.approx(ddp[0]["stats"]["bytes_sent"], rel=0.01)
        for name, value in ddp[0]["params"].items():
            torch.testing.assert_close(hv["params"][name], value, rtol=0, atol=0, msg=f"{kind} {spec} {name}")
        assert_params_equal(horovod[0][f"{kind}-{spec}"], horovod[1][f"{kind}-{spec}"], "Horovod replicas")
    # A freeze held past a hand-set warm-up, then 3-bit and the ternary tail that keeps the budget: both Horovod
    # ranks open alike and train bitwise as the simulation of the same run.
    import test_freeze_gate as gate

    engine, used, params = gate.simulate_late_freeze()
    for rank in range(2):
        late = horovod[rank]["late-freeze"]
        assert late["opened"] == engine.transform.gate.opened == gate.LATE_WARMUP + 1
        assert late["used"] == [type(c).__name__ for c in used] and "TwoBit" in late["used"]
        assert all(torch.equal(a, b) for a, b in zip(late["params"], params)), f"late-freeze, rank {rank}"
        assert late["stats"]["dense_bytes"] / late["stats"]["bytes_sent"] >= 8.0
