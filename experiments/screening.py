"""What the research screens share (``experiments/results/research-*/screens/``): a study run cut short.

The screens change a piece of the recipe from outside (a constant, a patched function) and run the
study's own simulation of 2 ranks; :func:`run_prefix` runs the first steps of one of its runs,
:func:`with_density` changes the density its sparsity schedule gives, :func:`recorded_engines` hands a
screen the engines that run builds, and :func:`topk_by_score` is a top-k compression whose selection a
screen chooses.
"""
from __future__ import annotations

import os

# One thread for every pool, as the study's runs have (experiments.simrun.main), set before Numba first loads
# its OpenMP pool: two screens side by side, each with Numba's whole pool, ran their compressed steps 27x
# slower than the study's (charlm-small, SGD-momentum top-k: 0.98 s against 0.036 s a step) before the
# kernels took torch's thread count (gradcomp.backends.numba.concurrency).
for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

import torch  # noqa: E402

from experiments import simrun  # noqa: E402
from experiments.convergence import RunSpec  # noqa: E402
from experiments.suite import STEPS  # noqa: E402

__all__ = ["run_prefix", "run_whole", "with_density", "recorded_engines", "topk_by_score"]


def run_whole(log: str, workload: str, method: str, seed: int = 0, optimizer: str = "adamw") -> None:
    """The study's whole run of ``workload``/``optimizer``/``method`` (``seed``, its length, its evaluations),
    logged to ``log``, on one thread as the study's."""
    from experiments.convergence import EVALS

    torch.set_num_threads(1)
    steps = STEPS[workload]
    simrun.run(RunSpec(workload, optimizer, method, seed, steps, max(1, steps // EVALS)), log)


def run_prefix(stop: int, log: str, workload: str, optimizer: str, method: str, seed: int = 0) -> None:
    """The study's run of ``workload``/``optimizer``/``method`` (``seed``, its length), its first ``stop``
    steps, logged to ``log``."""
    train_step = simrun._train_step

    def limited(sim, workload_, loop, step, schedulers):
        if step >= stop:
            raise KeyboardInterrupt  # the first STOP steps of the study's schedule
        return train_step(sim, workload_, loop, step, schedulers)

    simrun._train_step = limited
    try:
        simrun.run(RunSpec(workload, optimizer, method, seed, STEPS[workload], STEPS[workload] // 50), log)
    except KeyboardInterrupt:
        pass
    finally:
        simrun._train_step = train_step


def with_density(density_at) -> None:
    """Patch :class:`gradcomp.schedule.SparsityRamp` (for the process's life) so that a compressed step at
    ``step`` uses ``density_at(step, density)`` in place of the schedule's ``density`` (the dense start
    stays dense); each density's compressor is built once."""
    from gradcomp import schedule

    compressor_at = schedule.SparsityRamp.compressor_at
    built = {}

    def patched(self, step, base):
        compressor = compressor_at(self, step, base)
        if compressor is None:
            return None
        density = density_at(step, getattr(compressor, "density", 1.0))
        if density == getattr(compressor, "density", 1.0):
            return compressor
        if density not in built:
            built[density] = schedule._with_density(base, density)
        return built[density]

    schedule.SparsityRamp.compressor_at = patched


def recorded_engines() -> list:
    """A list that receives every engine the study's next simulated run builds (one per rank, in rank
    order), from :mod:`experiments.simrun`'s set-up, patched here (for the process's life)."""
    engines = []
    attach_of = simrun._attach

    def recording_attach(spec, schedulers):
        attach = attach_of(spec, schedulers)

        def attach_recorded(rank, replica, optimizer, transport):
            engines.append(attach(rank, replica, optimizer, transport))
            return engines[-1]

        return attach_recorded

    simrun._attach = recording_attach
    return engines


def topk_by_score(compressor, tensor: torch.Tensor, residual, residual_out, score):
    """A :class:`~gradcomp.compressors.TopK` payload of ``acc = tensor + residual`` (float32 ``[n]``) that
    sends ``acc`` at the ``compressor.k(n)`` entries of largest ``score(acc)`` (float32 ``[n]``), in place of
    the largest ``|acc|``; ``residual_out`` (mutated) receives ``acc`` with those entries zeroed."""
    payload = compressor.layout(tensor.numel(), tensor.dtype).allocate(tensor.device)
    acc = tensor.float() + (residual if residual is not None else 0)
    chosen = torch.topk(score(acc), compressor.k(tensor.numel()), sorted=False).indices.sort().values
    payload["values"].copy_(acc[chosen])
    payload["indices"].copy_(chosen)
    if residual_out is not None:
        residual_out.copy_(acc)
        residual_out[chosen] = 0
    return payload
