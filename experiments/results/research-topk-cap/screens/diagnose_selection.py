"""Which parameters the group-wide top-k starves: the study's top-k run (seed 0, its loop and recipe),
its first STEPS steps, with every simulated rank's compressions watched. Per parameter, over the compressed steps: the
share of its elements sent per step (against the density), and the ratio of its residual's norm to its
gradient's norm after the step (about how many steps' worth of gradient it holds back). Writes
``OUT`` (JSON, one row per parameter) and prints the rows by the residual ratio.

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-topk-cap/screens/diagnose_selection.py STEPS LOG OUT
[WORKLOAD [OPTIMIZER]]``
"""
import json
import sys
from collections import defaultdict

import torch

from experiments.screening import run_prefix
from gradcomp.compressors import TopK
from gradcomp.engine import Engine


def main(stop: int, log: str, out: str, workload: str = "gpt", optimizer: str = "sgdm") -> None:
    torch.set_num_threads(1)
    layouts = {}  # group size -> (keys, numels), from the engine
    sums = defaultdict(lambda: defaultdict(float))
    start, compress = Engine.start, TopK.compress

    def noting(self, grad, keys, numels, group):
        layouts[grad.numel()] = (tuple(keys), tuple(numels))
        return start(self, grad, keys, numels, group)

    def watched(self, tensor, residual=None, residual_out=None, backend=None):
        payload = compress(self, tensor, residual, residual_out, backend)
        if residual_out is None or tensor.numel() not in layouts:
            return payload
        keys, numels = layouts[tensor.numel()]
        sent = torch.zeros(tensor.numel(), dtype=torch.bool)
        sent[payload["indices"].long()] = True
        offset = 0
        for key, n in zip(keys, numels):
            row = sums[key]
            row["numel"], row["density"] = n, self.density
            row["steps"] += 1
            row["sent_share"] += float(sent[offset:offset + n].float().mean())
            g = float(tensor[offset:offset + n].float().norm())
            row["residual_over_grad"] += float(residual_out[offset:offset + n].norm()) / max(g, 1e-30)
            offset += n
        return payload

    Engine.start, TopK.compress = noting, watched
    run_prefix(stop, log, workload, optimizer, "topk")
    rows = [{"parameter": key, "numel": int(r["numel"]), "compressions": int(r["steps"]),
             "sent_share_per_step": r["sent_share"] / r["steps"],
             "residual_over_grad": r["residual_over_grad"] / r["steps"]} for key, r in sums.items()]
    rows.sort(key=lambda r: -r["residual_over_grad"])
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
    for r in rows:
        print(f"{r['parameter']:32s} {r['numel']:8d}  sent/step {r['sent_share_per_step']:.4f}  "
              f"|e|/|g| {r['residual_over_grad']:.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], *sys.argv[4:])
