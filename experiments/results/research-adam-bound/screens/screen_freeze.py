"""The study's AdamW top-k run with the recipe's dense start (the freeze of Adam's variance) at a larger share of
the run: ``gradcomp.recipe.DENSE_FRACTION`` set to ``FRACTION`` (the byte budget still caps it).

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-adam-bound/screens/screen_freeze.py FRACTION WORKLOAD SEED LOG``
"""
import sys

from experiments.screening import run_prefix
from experiments.suite import STEPS
from gradcomp import recipe


def main(fraction: float, workload: str, seed: int, log: str) -> None:
    recipe.DENSE_FRACTION = fraction
    run_prefix(STEPS[workload], log, workload, "adamw", "topk", seed)


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4])
