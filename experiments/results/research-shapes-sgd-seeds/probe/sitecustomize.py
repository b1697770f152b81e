"""Probes of the recipes on shapes under SGD-momentum, loaded into every run's process through ``PYTHONPATH``.

Not gradcomp: each variable changes one thing of the one-call recipe for a research run (README beside this
directory), and nothing when unset::

    GC_TAIL=N     every step from N on dense (the engine flushes the residuals into the first of them)
    GC_HEAD=N     every step before N dense (the plan's own schedule after it)
    GC_DECAY=X    3-bit's residual decay under SGD (the recipe's RESIDUAL_DECAY, 0.9) set to X
    GC_NODELAY=1  top-k's momentum not shortened on compressed steps (DelayedMomentumSGD's delay 0)
    GC_GRANULARITY=G  the engine's granularity the plan asks for set to G ("parameter": top-k per parameter)
    GC_TRACE=DIR  each group's averaged gradient and residual norms at every step, to DIR/trace-PID.jsonl
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
if os.environ.get("GC_TRACE"):
    import json

    import gradcomp.engine as engine_module

    commit = engine_module.Engine._commit
    trace = open(os.path.join(os.environ["GC_TRACE"], f"trace-{os.getpid()}.jsonl"), "a")

    def traced(self, context, handle, average):
        commit(self, context, handle, average)
        squares = [float(r.float().pow(2).sum()) for r in map(self.residual_memory.residual, handle.keys)
                   if r is not None]
        trace.write(json.dumps({"engine": id(self), "step": self.step, "group": str(handle.group),
                                "average": float(average.float().norm()), "residual": sum(squares) ** 0.5,
                                "compressor": repr(handle.compressor)}) + "\n")

    engine_module.Engine._commit = traced
