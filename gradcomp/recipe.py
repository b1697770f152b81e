"""The one-call recipe: a compressor's schedule and optimizer stage, derived from the run.

Every choice follows from what the run states (its length, its LR scheduler, its optimizer) and
from mechanisms that hold whatever the model, each measured on four workloads of different kinds
(a transformer and a GRU language model, each under AdamW and SGD-momentum; the convergence study,
``experiments/results/convergence/``):

* **2-bit is at least the chunk-scaled code** (``TwoBit("chunk")``, under SGD and Adam the 3-bit code,
  below): a level per 64 elements from the chunk's own statistics. MXNet's fixed threshold and a
  per-tensor RMS drain a large coordinate by ``t`` a step; with the chunk's own level 2-bit went from
  +27-32% above dense held-out loss to +0.2-0.9% on three of the four cells. A ``TwoBit`` of another
  threshold given to the recipe is replaced by it, with a notice.
* **2-bit is the 3-bit code under SGD and Adam** (``ThreeBit()``): seven levels ``q * s``, ``s`` the largest
  magnitude of each 128 elements / 3, in the same byte budget (paid for by a shorter dense start). Under
  SGD-momentum the ternary code lags dense from its first compressed steps (600 steps, a GPT, seeds
  0-2, and charlm-small, seeds 0-4: +13.6 to +16.1% and +11.6% median; seven levels -0.4 to +0.8% and
  +1.7%). Under AdamW at the study's length (``experiments/results/research-threebit-adamw/``) seven
  levels beat the ternary code on all five workloads though the dense start shrinks to the budget's:
  charlm-small +0.8% median against +2.5% (seeds 0-2), the GPT -4.7% against -0.8%, proselm -8.5%
  against +0.5%. Under Adam the dearer payload must still leave the frozen variance its samples: where
  3-bit's dense start is shorter than :data:`~gradcomp.optim.adam_settings.MIN_STEADY_FREEZE` steps and
  the ternary code's longer, the ternary code runs (charlm-small, AdamW, 200 steps: 3-bit's 2 dense
  steps ended +18.2%, the ternary code's 8 -0.3%). Other optimizers keep the ternary code (not
  measured). :func:`code` gives the choice alone.
* **a decaying residual under SGD** (3-bit): each committed residual is multiplied by
  :data:`RESIDUAL_DECAY`, so an error held back ``k`` steps ago counts ``0.9**k`` (DeMo decays its
  buffer alike): after a spike a plain residual hands stale large gradients back for many steps.
  Measured, SGD-momentum: charlm-small, seed 0, +49.3% above dense with plain error feedback, -2.1% decayed
  (de9ca4e); the GPT, proselm, digits-mlp and shapes unchanged. Until acf1caf the decay reached only groups of
  one parameter (not a DDP bucket's); applied to every group, charlm-small's seeds 0-4 end -3.0/+16.3/-20.3/
  -1.4/+4.7% (before: -2.4/+18.2/-20.3/-1.6/+4.4%; seeds 1 and 2 jump early, dense on seed 2 too).
* **dense start** ``D``: the end of the learning-rate warm-up, read from the LR scheduler (the step
  of its peak learning rate, found by stepping a copy of it), and at least :data:`DENSE_FRACTION` of
  the run, :data:`ADAM_DENSE_FRACTION` under Adam (its second moment is estimated there, then frozen),
  as far as the byte budget allows. Compression that starts inside the warm-up stores the large early
  gradients and releases them late, but the budget is the user's promise, so a scheduler's warm-up too
  long for it is cut short, with a notice (measured harmless where it happens in the study: charlm-small,
  AdamW, 200 steps, 8 dense steps of a 20-step warm-up, -0.3%). A loop that sets the rate by hand (no
  scheduler) hides its warm-up from the plan, and under Adam a variance frozen inside it kept an unclipped
  GPT from training: there the stage reads the rate at every optimizer step and holds the freeze, and with it
  the dense start, until the rate has stopped rising, up to :data:`ADAM_DENSE_FRACTION` of the run
  (:mod:`gradcomp.optim.freeze_gate`); the plan after it keeps the byte budget (:func:`_replan`). Bytes
  are counted from each compressed parameter's own payload layout (:mod:`gradcomp.recipe_bytes`).
* **Adam's dense start in 16 bits**: its steps after DDP's first two go as an fp16 cast (torch's fp16 hook's
  bytes; no residual). Measured, AdamW, five workloads, seeds 0-2 (the convergence study): the language models
  within 0.4 % of their dense-started ends, the classifiers at the same accuracy, top-k 12.1-12.7x fewer bytes
  than dense over the run against 8.0x. The
  plan keeps a dense start's lengths (the budget then holds with room to spare) and counts the cast's bytes.
  Not under SGD (the GPT's top-k ended +3.0 / +2.5 / +0.9 %, seeds 0-2, against +2.1 / +1.3 / +1.1 % with a
  dense start: not shown harmless), a policy (``Auto`` times dense steps to measure the link), nor sharded.
* **sparsity ramp** (top-k): densities halving from the densest of ``1/4, 1/8, 1/16`` that the budget
  affords down to the density asked, each stage as long as the byte budget (``min_compression`` x fewer
  bytes than dense over the whole run) allows, over :data:`RAMP_MIN_FRACTION` to :data:`RAMP_FRACTION`
  of the steps after ``D``; a run too short for the budget keeps the ramp and says the budget is missed.
* **compact top-k entries**: top-k at density ``d`` runs as ``TopK(2 * d, entries="compact")``, twice
  the entries in the same bytes (a bfloat16 value and a 16-bit index inside a 65,536-element chunk, 4
  bytes an entry against 8; what bfloat16 rounds off stays in the residual). Under SGD-momentum, seeds
  0-2 (``experiments/results/research-topk-compact/``): the GPT +2.1/+1.3/+1.1% above dense against
  +2.8% median with 8-byte entries, charlm-small +0.9/+1.7/+0.7% against +2.4%.
* **top-k under SGD selects over the whole group** (``granularity="bucket"``): in gradient units the
  largest entries of the group are the largest first-order decrease, where a share per parameter spends
  the budget on tensors whose gradients are small. Measured at 1000 steps, SGD-momentum, seed 0: a GPT
  +17.7% above dense held-out loss with a share per parameter, +9.4% with the group's own top-k; on a
  GRU, an MLP and a CNN the two ended alike (+1.5%/+1.4%, 0.0/+0.2 accuracy points, -0.2/-0.2 points).
  Under Adam the stage's update units already put every tensor on one scale, and quantizers scale each
  chunk themselves, so both keep the engine's default (each parameter on its own).
* **optimizer stage**: Adam/AdamW gets :class:`~gradcomp.optim.FrozenVarianceAdam` (variance frozen
  at ``D``, the gradient compressed in Adam's update units; under a sparsifier each coordinate's late gradient
  caught up as the first moment would have taken it on time, :mod:`gradcomp.optim.catch_up`, without the spike
  guard, which would scale back the bursts it owes). Measured, top-k under AdamW, seed 0, final held-out loss
  against dense, the catch-up (until it, each rank's first moment exchanged, its ``beta1`` shortened by the delay
  error feedback adds, :mod:`gradcomp.optim.delay`): charlm-small -1.1 %
  (+1.3 %), the GPT -3.5 % (-1.4 %), proselm -2.5 % (-1.0 %), digits-mlp -7.1 % (-12.7 %; accuracy 0.973 against
  dense's 0.976), shapes -76.7 % (-84.6 %), the GPT without its clip -2.1 % (-0.4 %), the main job's 200 steps
  reaching the target with dense at step 151 (167; ``experiments/results/research-topk-adam-catchup/``).
  Under SGD the compressed gradient (error feedback, ``.grad`` the average gradient) goes into the user's own
  SGD, whose momentum runs after the exchange on every rank alike; with a sparsifier and momentum,
  :class:`~gradcomp.optim.DelayedMomentumSGD` applies each coordinate's late gradient as the momentum would have
  applied it on time (its wait read from the average; no constant of a model; not under FSDP, whose shards it
  has not been run on). Other optimizers get error feedback and a notice.

What the user's loop sees does not change: after ``backward()`` every ``.grad`` holds the average
gradient in gradient units, so clipping, ``GradScaler``, gradient logging and a learning
rate set by hand behave as without gradcomp. :attr:`Plan.summary` says what was chosen, as a
:class:`~gradcomp.setup.RecipeNotice` at registration; a run longer than ``total_steps`` says so
once and keeps the final setting, and one that ends before half of it says so at exit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

import torch

from gradcomp.compressors import FP16, Compressor, ThreeBit, TopK, TwoBit, from_spec
from gradcomp.lr_schedule import lr_peak_step, plannable
from gradcomp.recipe_bytes import Traffic, bytes_per_element
from gradcomp.recipe_stage import optimizer_stage
from gradcomp.schedule import EXACT_DENSE_STEPS, CodeSwitch, DenseWarmup, PlannedSchedule, SparsityRamp
from gradcomp.settings import DEFAULT_MIN_NUMEL, check_compressor

__all__ = ["Plan", "plan", "code", "lr_peak_step", "DENSE_FRACTION", "ADAM_DENSE_FRACTION", "RAMP_FRACTION",
           "MIN_COMPRESSION", "RESIDUAL_DECAY", "PlannedSchedule"]

#: The share of the run that starts dense when the LR warm-up is shorter or unknown, as long as the
#: byte budget allows it (2-bit's code costs 7.8% of dense, which leaves about 4% of the run for an
#: 8x budget): measured on charlm-small (AdamW, 2-bit), a 3% and a 5% dense start ended alike; under
#: SGD-momentum top-k's longer start (8%, its ramp then shorter) ended worse on both transformers and
#: the GRU (seed 0: charlm-small +6.8% against +4.1%, the GPT +5.2% against +4.2%, proselm +1.1%
#: against +0.8%).
DENSE_FRACTION = 0.05
#: The same under Adam, whose dense start is also the window its variance is estimated in before the
#: freeze: PowerSGD starts compressing after about 10% of the steps, 1-bit Adam freezes after a
#: warm-up of 15-25%. The budget caps it (top-k's ramp leaves about 8%). Measured, AdamW top-k, seed 0:
#: a CNN whose variance froze on its first plateau (5%) diverged (accuracy 0.110) and reached 0.998 at
#: 8%; proselm +0.7% against +1.5%; charlm-small and the GPT alike (+0.8% / -1.7% against +0.5% / -2.2%).
ADAM_DENSE_FRACTION = 0.1
#: The share of the steps after the dense start that the sparsity ramp takes: at least the first,
#: at most the second; between them the byte budget decides. The floor: charlm-small (AdamW, 200 steps,
#: bfbf46e: a ramp over 1/4 of the steps ended +3.7% above dense, over 1/2 +2.8%, none +6.3%), and under
#: AdamW on the GPT, proselm and the shapes CNN flat from 0.25 to 0.55 (all within 2% of dense, seed 0;
#: experiments/results/research-ramp/). The cap binds only below the recipe's density (at "topk:0.01" the
#: budget ends the ramp first); at "topk:0.0025" under SGD-momentum, the GPT and proselm from 0.6 to 0.9
#: move by 0.1-0.3% and about 1x of compression a step of 0.15, all within 2% of dense (same README).
RAMP_MIN_FRACTION = 0.4
RAMP_FRACTION = 0.75
#: The byte budget over the whole run, dense start included: dense bytes / bytes sent, at least.
MIN_COMPRESSION = {"topk": 8.0, "twobit": 8.0, "threebit": 8.0}
#: First densities the ramp may start at, densest first (the densest the byte budget affords over the ramp's
#: shortest length is taken); each next stage halves it. Chosen, not tuned: DGC's first stage (1/4) and two sparser.
RAMP_STARTS = (1 / 4, 1 / 8, 1 / 16)
#: The residual decay of 3-bit under SGD: a memory of about 10 steps, as momentum 0.9's (0.5 forgot too
#: fast on charlm-small; on top-k it hurt).
RESIDUAL_DECAY = 0.9
#: The recipe's 2-bit code.
TWOBIT = "chunk"
#: The compressors the recipe plans for, by the family name of :data:`MIN_COMPRESSION`.
_FAMILIES = (("topk", TopK), ("twobit", TwoBit), ("threebit", ThreeBit))


@dataclass
class Plan:
    """What :func:`plan` chose for a run; ``schedule`` and ``transform`` go to the engine."""

    compressor: Compressor
    total_steps: int
    dense_steps: int
    schedule: object
    transform: object = None
    optimizer_stage: str = "error feedback"
    expected_compression: float = 1.0
    notes: Sequence[str] = field(default_factory=tuple)
    #: Compressor classes that do not converge with this optimizer stage (a policy must not pick them).
    unsuited: Tuple[type, ...] = ()
    #: The engine's ``granularity`` the plan asks for (``None``: the engine's default).
    granularity: Optional[str] = None
    #: The engine's ``residual_decay`` (1: plain error feedback).
    residual_decay: float = 1.0

    @property
    def summary(self) -> str:
        ramp = ""
        inner = getattr(self.schedule, "inner", self.schedule)
        if isinstance(inner, SparsityRamp):
            stages = inner.stages(self.compressor)
            ramp = f", ramp {'/'.join(f'{d:.4g}' for d in stages)} x {inner.stage_steps} steps"
        whole = ", each group's top-k over the whole group" if self.granularity == "bucket" else ""
        start = getattr(self.schedule, "start", None)
        cast = f" ({start!r} from step {EXACT_DENSE_STEPS})" if start is not None else ""
        whole += f", residuals decayed {self.residual_decay:g} a step" if self.residual_decay != 1.0 else ""
        return (f"{self.compressor!r}{whole} with {self.optimizer_stage}: {self.dense_steps} dense steps{cast} of "
                f"{self.total_steps}{ramp}; about {self.expected_compression:.1f}x fewer bytes than dense")


def _ramp(compressor: TopK, total: int, dense_steps: int, budget: float,
          traffic: Traffic) -> Tuple[Tuple[float, ...], int]:
    """The densest ramp (of :data:`RAMP_STARTS`) whose stages fit ``budget`` (a share of dense bytes)
    for at least :data:`RAMP_MIN_FRACTION` of the steps after the dense start; the last start otherwise."""
    for start in RAMP_STARTS:
        densities, stage, fits = _ramp_from(start, compressor, total, dense_steps, budget, traffic)
        if fits:
            break
    return densities, stage


def _ramp_from(start: float, compressor: TopK, total: int, dense_steps: int, budget: float,
               traffic: Traffic) -> Tuple[Tuple[float, ...], int, bool]:
    """``(densities, stage length, whether the budget affords the shortest ramp)`` from ``start``."""
    final = compressor.density
    densities, d = [], start
    while d > final * (1 + 1e-9) and len(densities) < 8:
        densities.append(d)
        d /= 2
    if not densities:
        return (), 0, True
    rest = total - dense_steps
    c_final = bytes_per_element(compressor, final, traffic)
    spare = budget * total - dense_steps - rest * c_final  # bytes (in dense steps) the ramp may spend
    extra = sum(bytes_per_element(compressor, d, traffic) - c_final for d in densities)
    affordable = int(spare / extra) if spare > 0 else 0
    shortest, longest = (int(fraction * rest / len(densities)) for fraction in (RAMP_MIN_FRACTION, RAMP_FRACTION))
    stage = min(max(affordable, shortest), longest)
    return ((tuple(densities), stage) if stage >= 1 else ((), 0)) + (affordable >= shortest,)


def _schedule(compressor, total_steps: int, dense_steps: int, budget: float, traffic: Traffic, start=None):
    """``(schedule, expected compression)`` for ``compressor`` after ``dense_steps`` dense steps (those from
    :data:`~gradcomp.schedule.EXACT_DENSE_STEPS` on in ``start`` where given)."""
    densities, stage = (_ramp(compressor, total_steps, dense_steps, budget, traffic) if isinstance(compressor, TopK)
                        else ((), 0))
    schedule = SparsityRamp(dense_steps, stage, densities) if stage else DenseWarmup(dense_steps)
    ramp_bytes = sum(stage * bytes_per_element(compressor, d, traffic) for d in densities)
    rest = total_steps - dense_steps - stage * len(densities)
    exact = dense_steps if start is None else min(dense_steps, EXACT_DENSE_STEPS)
    start_bytes = exact + (dense_steps - exact) * (bytes_per_element(start, None, traffic) if start else 1.0)
    sent = start_bytes + ramp_bytes + rest * bytes_per_element(compressor, None, traffic)
    return schedule, total_steps / sent


def _dense_start(compressor, total_steps: int, scheduler, budget: float, traffic: Traffic,
                 notes: list, fraction: float) -> int:
    """The dense start: the LR warm-up's end and at least ``fraction`` of the run, as far as
    the byte budget allows: what is left of it once every later step sends the final setting and, for
    top-k, once the sparsity ramp has its shortest length from its sparsest start (without that share a
    run whose warm-up is long next to its length spent the whole budget on dense steps and then ran a
    ramp it could no longer afford: the main job's 200 steps, warm-up 20, went 19 dense steps, 7.2x
    fewer bytes, +10.3% held-out loss; 16 dense steps: 8.0x, +2.5 to +5.0% on five seeds, where 8 and
    12 dense steps blew up on one and two seeds of five). 2 at least. A warm-up longer than the budget
    allows is noted: compression then starts inside it."""
    warmup_end = lr_peak_step(scheduler, total_steps) if scheduler is not None else 0
    final = bytes_per_element(compressor, None, traffic)
    affordable = int(total_steps * (budget - final) / (1 - final)) if final < 1 else 0
    if isinstance(compressor, TopK):
        while affordable > 2 and not _ramp_from(RAMP_STARTS[-1], compressor, total_steps, affordable, budget,
                                                 traffic)[2]:
            affordable -= 1
    wanted = max(warmup_end, math.ceil(fraction * total_steps))
    if warmup_end > affordable:
        notes.append(f"the LR warm-up ends at step {warmup_end}, but the byte budget affords {max(2, affordable)} "
                     "dense steps: compression starts inside the warm-up")
    return min(total_steps, max(2, min(wanted, affordable)))


def plan(compressor, optimizer=None, total_steps: Optional[int] = None, scheduler=None,
         named_parameters: Sequence[Tuple[str, torch.nn.Parameter]] = (), min_numel: int = DEFAULT_MIN_NUMEL,
         min_compression: Optional[float] = None, step_hook: bool = True, announce: bool = True,
         sharded: bool = False, cast_start: bool = True) -> Plan:
    """Derive the schedule and the optimizer stage of ``compressor`` for this run (module docstring).

    Args:
        compressor: a compressor or its spec (``"topk:0.01"``, ``"twobit:chunk"``).
        optimizer: the user's optimizer; Adam/AdamW gets a step pre-hook
            (:class:`~gradcomp.optim.FrozenVarianceAdam`), any other is left as it is.
        total_steps: optimizer steps in the run (required).
        scheduler: the LR scheduler, if any: its warm-up sets the dense start (``lr_schedule.plannable``).
        named_parameters: ``(name, parameter)`` of the averaged parameters (the stage's keys).
        min_numel: parameters under it travel dense (their share counts against the budget).
        min_compression: the byte budget, dense bytes / bytes sent over the run (default
            :data:`MIN_COMPRESSION` of the compressor's family).
        step_hook: how a stage reaches the optimizer's step (a pre-hook, or the integration calls it).
        announce: whether this process shows the recipe's notices (one rank speaks for all).
        sharded: FSDP's parameters (the SGD stage and the 16-bit dense start are left out).
        cast_start: Adam's dense start's steps after the first two as an fp16 cast (module docstring).
    """
    from gradcomp.setup import notice

    compressor = check_compressor(from_spec(compressor) if isinstance(compressor, str) else compressor)
    scheduler = plannable(scheduler)
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"the recipe needs total_steps=<optimizer steps in the run> (an integer >= 1), "
                         f"got {total_steps!r}")
    traffic = Traffic.of(named_parameters, min_numel)
    compressor = code(compressor, optimizer, total_steps, scheduler, traffic, min_compression, announce)
    family = next((name for name, kind in _FAMILIES if isinstance(compressor, kind)), None)
    if family is None:  # casts: no residual, no recipe needed beyond DDP's rebuild
        return Plan(compressor, total_steps, 2, PlannedSchedule(DenseWarmup(2), total_steps, announce), None,
                    "no error feedback (a cast)", notes=("casts need no recipe",))
    budget = min_compression or MIN_COMPRESSION[family]
    notes = []
    fraction = ADAM_DENSE_FRACTION if isinstance(optimizer, torch.optim.Adam) else DENSE_FRACTION
    dense_steps = _dense_start(compressor, total_steps, scheduler, 1 / budget, traffic, notes, fraction)
    adam = isinstance(optimizer, torch.optim.Adam)
    start = FP16() if cast_start and adam and not sharded else None
    schedule, expected = _schedule(compressor, total_steps, dense_steps, 1 / budget, traffic, start)
    if expected * 1.001 < budget:
        notes.append(f"the dense start ({dense_steps} steps) and the ramp of this {total_steps}-step run leave "
                     f"{expected:.1f}x fewer bytes, under the {budget:.0f}x asked")
    latest = (max(dense_steps, math.ceil(ADAM_DENSE_FRACTION * total_steps)) if scheduler is None else dense_steps)
    replan = _replan(compressor, traffic, total_steps, dense_steps, budget, start)
    transform, stage_name = optimizer_stage(optimizer, compressor, list(named_parameters), dense_steps, notes,
                                            step_hook, sharded, latest, _delay_cost(replan, total_steps, budget))
    gate = transform if hasattr(transform, "compresses_at") else None
    result = Plan(compressor, total_steps, dense_steps,
                  PlannedSchedule(schedule, total_steps, announce, gate, lambda delay: replan(delay)[0], start),
                  transform, stage_name, expected, tuple(notes), granularity=_granularity(optimizer, compressor),
                  residual_decay=_residual_decay(optimizer, compressor))
    notice(f"recipe: {result.summary}", announce)
    for note in notes:
        notice(f"recipe: {note}", announce)
    return result


def _replan(compressor, traffic: Traffic, total_steps: int, dense_steps: int, budget: float, start=None):
    """``replan(delay) -> (schedule, expected compression)``: the plan once the dense start (Adam's freeze) came
    ``delay`` steps late, the byte budget kept as far as the run affords: top-k's ramp planned from the later
    start, 3-bit's last steps in the ternary code, as many as pay back the extra dense steps (about 30 each)."""
    def replan(delay: int):
        later = min(total_steps, dense_steps + delay)
        schedule, expected = _schedule(compressor, total_steps, later, 1 / budget, traffic, start)
        if isinstance(compressor, ThreeBit) and expected * 1.001 < budget:
            finer, ternary = (bytes_per_element(c, None, traffic) for c in (compressor, TwoBit(TWOBIT)))
            excess = total_steps / expected - total_steps / budget
            switched = min(total_steps - later, math.ceil(excess / (finer - ternary) - 1e-9))
            schedule = CodeSwitch(later, total_steps - switched, TwoBit(TWOBIT))
            expected = total_steps / (total_steps / expected - switched * (finer - ternary))
        return schedule, expected

    return replan


def _delay_cost(replan, total_steps: int, budget: float):
    """``cost(delay) -> str``: the run's compression after ``replan(delay)``, for the freeze's notice."""

    def cost(delay: int) -> str:
        schedule, ratio = replan(delay)
        how = (f" (its last {total_steps - schedule.switch_step} steps in {schedule.later!r})"
               if isinstance(schedule, CodeSwitch) else "")
        short = f", under the {budget:g}x asked" if ratio * 1.001 < budget else ""
        return f"about {ratio:.1f}x fewer bytes than dense over the run{how}{short}"

    return cost


def code(compressor, optimizer=None, total_steps: int = 1, scheduler=None, traffic: Optional[Traffic] = None,
         min_compression: Optional[float] = None, announce: bool = False) -> Compressor:
    """The compressor the recipe runs for ``compressor`` (module docstring), without side effects: a
    ``TwoBit`` becomes ``ThreeBit()`` under SGD, and under Adam where the byte budget affords 3-bit
    :data:`~gradcomp.optim.adam_settings.MIN_STEADY_FREEZE` dense steps or as many as the ternary code's;
    else ``TwoBit("chunk")``. A wide ``TopK(d)`` becomes ``TopK(2 * d, entries="compact")`` (the same
    bytes; ``d`` above 1/2 stays as it is). Any other compressor is returned as it is. ``traffic``: the
    averaged parameters (:meth:`Traffic.of`; a nominal tensor where ``None``); the notices say what was
    substituted and why."""
    from gradcomp.optim.adam_settings import MIN_STEADY_FREEZE
    from gradcomp.setup import notice

    traffic = traffic or Traffic()
    if isinstance(compressor, TopK):
        return _compact(compressor, announce)
    if not isinstance(compressor, TwoBit):
        return compressor
    name = type(optimizer).__name__
    finer, ternary = ThreeBit(), TwoBit(TWOBIT)
    if isinstance(optimizer, (torch.optim.SGD, torch.optim.Adam)):
        if isinstance(optimizer, torch.optim.Adam):  # SGD has no variance to estimate: 3-bit whatever the start
            budget = 1 / (min_compression or MIN_COMPRESSION["threebit"])
            steps = _dense_start(finer, total_steps, scheduler, budget, traffic, [], ADAM_DENSE_FRACTION)
            ternary_steps = _dense_start(ternary, total_steps, scheduler, budget, traffic, [], ADAM_DENSE_FRACTION)
        if isinstance(optimizer, torch.optim.SGD) or steps >= min(MIN_STEADY_FREEZE, ternary_steps):
            notice(f"recipe: under {name} 2-bit runs as ThreeBit(), seven levels with a scale per 128 elements, in "
                   "the same byte budget (measured: SGD-momentum, 600 steps, a GPT +13.6-16.1% above dense with "
                   "the ternary code, -0.4-+0.8% with seven levels; AdamW, charlm-small, 2000 steps, +2.5% against "
                   "+0.8%)", announce)
            return finer
        notice(f"recipe: under {name} 2-bit runs as TwoBit({TWOBIT!r}), not ThreeBit(): 3-bit's dearer payload "
               f"would leave {steps} dense steps of this {total_steps}-step run for Adam's variance before the "
               f"freeze, the ternary code {ternary_steps} (measured: charlm-small under AdamW, 200 steps: 2 dense "
               "steps and 3-bit +18.2% above dense, 8 and the ternary code -0.3%)", announce)
        return ternary
    if not compressor.chunked:
        notice(f"recipe: 2-bit runs as TwoBit({TWOBIT!r}), a level per 64 elements, in place of {compressor!r} "
               "(measured: +27-32% held-out loss over dense with a per-tensor threshold, +0.2-0.9% with the "
               "chunk's own level)", announce)
    return ternary


def _compact(compressor: TopK, announce: bool) -> TopK:
    """``compressor`` with compact entries at twice its density, the same bytes (module docstring)."""
    from gradcomp.setup import notice

    if compressor.compact or compressor.density > 0.5:
        return compressor
    compact = TopK(2 * compressor.density, entries="compact")
    notice(f"recipe: top-k runs as {compact!r} in place of {compressor!r}: twice the entries in the same bytes "
           "(4 bytes an entry: a bfloat16 value, a 16-bit index inside its chunk; measured under SGD-momentum: "
           "the GPT +1.3% and charlm-small +0.9% above dense, against +2.8% and +2.4% with 8-byte entries)",
           announce)
    return compact


def _granularity(optimizer, compressor) -> Optional[str]:
    """``"bucket"`` for top-k under SGD (module docstring), else ``None``."""
    return "bucket" if isinstance(compressor, TopK) and isinstance(optimizer, torch.optim.SGD) else None


def _residual_decay(optimizer, compressor) -> float:
    """:data:`RESIDUAL_DECAY` for 3-bit under SGD (module docstring), else 1."""
    return RESIDUAL_DECAY if isinstance(compressor, ThreeBit) and isinstance(optimizer, torch.optim.SGD) else 1.0
