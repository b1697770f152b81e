"""Wall-clock totals of the step's named functions on rank 0, by thread (``ab.py --walltime``).

cProfile's own overhead inflates Python, and its per-function times pick up what a thread waits for (the GIL,
the core the other rank and Gloo's threads share): it once put 0.18 ms a call into Numba's thread-count setter,
which removed changed no step. These totals wrap a few functions with ``time.perf_counter`` and say which
thread ran them (the training thread, or Gloo's callback thread); nested functions are counted in both.
"""
import collections
import functools
import threading
import time

TOTALS = collections.defaultdict(float)
CALLS = collections.Counter()


MISSING = []


def _wrap(owner, name: str, label: str) -> None:
    inner = getattr(owner, name, None)
    if inner is None:  # renamed or gone since: said in the report, not fatal
        MISSING.append(label)
        return

    @functools.wraps(inner)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            key = (label, threading.current_thread() is threading.main_thread())
            TOTALS[key] += time.perf_counter() - start
            CALLS[key] += 1

    setattr(owner, name, timed)


def install() -> None:
    """Wrap the functions (before the replicas are built: the hook is looked up at registration)."""
    import gradcomp.hooks.ddp as ddp
    from gradcomp import engine, inflight
    from gradcomp.compressors import per_parameter
    from gradcomp.exchanges import allgather
    from gradcomp.optim import frozen_adam, spike_guard

    for name in ("before_compress", "after_compress", "after_average", "before_optimizer_step", "commit"):
        _wrap(frozen_adam.FrozenVarianceAdam, name, f"stage.{name}")
    for name in ("caught_up_update", "frozen_update", "guard_factor"):
        _wrap(frozen_adam, name, f"stage.{name}")
    from gradcomp.optim import catch_up, live_level

    _wrap(live_level.LiveLevel, "factor", "level.factor")
    from gradcomp.backends.numba import caught_up_step

    for name in ("_run", "_table"):
        _wrap(caught_up_step, name, f"caught_up_step.{name}")
    _wrap(catch_up.Waits, "begin_step", "waits.begin_step")
    _wrap(catch_up.Waits, "record", "waits.record")
    _wrap(spike_guard.SpikeGuard, "scale", "guard.scale")
    _wrap(engine.Engine, "start", "engine.start")
    _wrap(engine.Engine, "finish", "engine.finish")
    _wrap(allgather.Allgather, "start", "allgather.start")
    _wrap(per_parameter.PerParameter, "compress", "per_parameter.compress")
    _wrap(ddp, "compression_hook", "hook")
    _wrap(ddp, "_all_gather_flat", "all_gather launch")
    _wrap(inflight, "hold", "inflight.hold")
    _wrap(inflight, "keep", "inflight.keep")
    # SGD-momentum's path (the digits MLP's fast-link cell)
    from gradcomp.compressors import topk
    from gradcomp.hooks import direct
    from gradcomp.optim import delayed_momentum

    for name in ("before_optimizer_step", "after_compress", "after_optimizer_step"):
        _wrap(delayed_momentum.DelayedMomentumSGD, name, f"sgd.{name}")
    for name in ("compress", "check_payload", "add_checked"):
        _wrap(topk.TopK, name, f"topk.{name}")
    _wrap(allgather.Allgather, "finish", "allgather.finish")
    _wrap(engine.Engine, "_commit", "engine._commit")
    _wrap(engine.Engine, "_compensate", "engine._compensate")
    _wrap(direct, "gather", "direct.gather")
    _wrap(engine.Engine, "end_step", "engine.end_step")
    _wrap(ddp.CompressionState, "layout", "state.layout")
    _wrap(inflight, "watch", "inflight.watch")
    _wrap(engine.Engine, "_transformed", "engine._transformed")
    _wrap(engine.Engine, "compressor_now", "engine.compressor_now")
    _wrap(engine.Engine, "exchange_for", "engine.exchange_for")


def reset() -> None:
    TOTALS.clear()
    CALLS.clear()


def report(steps: int) -> None:
    if MISSING:
        print("not wrapped (no such name now):", ", ".join(MISSING))
    for (label, main), seconds in sorted(TOTALS.items(), key=lambda item: -item[1]):
        thread, calls = ("training" if main else "callback"), CALLS[(label, main)] / steps
        print(f"{label:28s} {thread:8s} {seconds / steps * 1000:7.3f} ms/step  {calls:4.1f} calls")
