"""Probes of the recipes on shapes under SGD-momentum, loaded into every run's process through ``PYTHONPATH``.

Not gradcomp: each variable changes one thing of the one-call recipe for a research run (README beside this
directory), and nothing when unset::

    GC_TAIL=N     every step from N on dense (the engine flushes the residuals into the first of them)
    GC_HEAD=N     every step before N dense (the plan's own schedule after it)
    GC_DECAY=X    3-bit's residual decay under SGD (the recipe's RESIDUAL_DECAY, 0.9) set to X
    GC_NODELAY=1  top-k's momentum not shortened on compressed steps (DelayedMomentumSGD's delay 0)
    GC_GRANULARITY=G  the engine's granularity the plan asks for set to G ("parameter": top-k per parameter)
"""
import os

if os.environ.get("GC_TAIL") or os.environ.get("GC_HEAD"):
    import gradcomp.schedule as schedule

    tail, head = int(os.environ.get("GC_TAIL") or 1 << 62), int(os.environ.get("GC_HEAD") or 0)
    planned = schedule.PlannedSchedule.compressor_at

    def compressor_at(self, step, base):
        return None if step >= tail or step < head else planned(self, step, base)

    schedule.PlannedSchedule.compressor_at = compressor_at
if os.environ.get("GC_DECAY"):
    import gradcomp.recipe as recipe

    recipe.RESIDUAL_DECAY = float(os.environ["GC_DECAY"])
if os.environ.get("GC_NODELAY"):
    import gradcomp.optim.delayed_momentum as delayed

    init = delayed.DelayedMomentumSGD.__init__

    def undelayed(self, optimizer, named_parameters, delay_steps=0.0, step_hook=True):
        init(self, optimizer, named_parameters, 0.0, step_hook)

    delayed.DelayedMomentumSGD.__init__ = undelayed
if os.environ.get("GC_GRANULARITY"):
    import gradcomp.recipe as recipe_granularity

    recipe_granularity._granularity = lambda optimizer, compressor: os.environ["GC_GRANULARITY"]
