"""The workloads of the studies by name, each with its run length.

============  ====================================================  ===========  =======
name          model and data                                         kind         steps
============  ====================================================  ===========  =======
charlm-small  byte-level transformer on the standard library's code  transformer  2000
proselm       byte-level 2-layer GRU on English prose                recurrent    600
digits-mlp    MLP on scikit-learn's 8x8 digits                       MLP          1000
shapes        3-layer CNN on procedurally drawn shapes               CNN          600
gpt           GPT trained as single-file GPT scripts do (manual LR,  transformer  1000
              clip 1.0, two param groups, accumulation), on prose
gpt-noclip    the same without the clip: what the clip costs a recipe  transformer  1000
charlm-tiny   a 1-layer charlm (smoke runs)                          transformer  12
============  ====================================================  ===========  =======

The convergence study decided the recipe's design on ``charlm-small`` and ``proselm``
(:data:`DESIGNED_ON`); ``digits-mlp``, ``shapes`` and ``gpt`` judge it as held-out workloads.
"""
from __future__ import annotations

from typing import Dict

__all__ = ["build", "NAMES", "STEPS", "DESIGNED_ON", "HELD_OUT"]

STEPS: Dict[str, int] = {"charlm-small": 2000, "proselm": 600, "digits-mlp": 1000, "shapes": 600, "gpt": 1000,
                         "gpt-noclip": 1000, "charlm-tiny": 12, "digits": 1000}
NAMES = ("charlm-small", "proselm", "digits-mlp", "shapes", "gpt")
DESIGNED_ON = ("charlm-small", "proselm")
HELD_OUT = ("digits-mlp", "shapes", "gpt")


def build(name: str, seed: int = 0, eval_windows: int = 256):
    """The workload ``name`` (see the module docstring), built identically on every rank from ``seed``."""
    from experiments import workloads

    if name == "charlm-small":
        return workloads.build_workload("charlm", seed=seed, small=True, eval_windows=eval_windows)
    if name == "charlm-tiny":
        overrides = {"d_model": 32, "layers": 1, "heads": 2, "context": 16}
        return workloads.build_workload("charlm", seed=seed, small=True, charlm_overrides=overrides,
                                        eval_windows=eval_windows)
    if name == "proselm":
        return workloads.build_workload("proselm", seed=seed, eval_windows=eval_windows)
    if name == "digits":
        return workloads.build_workload("digits", seed=seed)
    if name in ("digits-mlp", "shapes"):
        from experiments import images

        return images.DigitsMLP(seed=seed) if name == "digits-mlp" else images.Shapes(seed=seed)
    if name in ("gpt", "gpt-noclip"):  # one model and data; the loops differ (experiments.loop)
        from experiments.gpt import PromptGPT

        return PromptGPT(seed=seed, eval_windows=eval_windows)
    raise ValueError(f"unknown workload {name!r}; choose one of {NAMES + ('gpt-noclip', 'charlm-tiny', 'digits')}")
