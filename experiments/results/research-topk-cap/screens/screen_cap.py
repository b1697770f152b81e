"""Top-k whose release is rate-limited: the study's top-k run (seed 0, its loop, length and recipe) with
what each rank sends for a group scaled down, where needed, so that its norm is at most ``CAP`` times the
norm of the group's gradient this step; what is held back stays in the residual (error feedback keeps it:
``e' = acc - sent``), so nothing is dropped, only spread over more steps.

Why: the GPT loop's clip helped top-k far more than dense (``experiments/results/gpt-clip/``: clip ÷ no
clip 0.93-0.95 for top-k, 0.99-1.01 for dense), and a clip drops what it cuts. A residual released after
``n`` steps moves a coordinate by ``n`` steps' worth at once; the cap bounds that burst by the step's own
gradient and keeps the rest.

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-topk-cap/screens/screen_cap.py CAP STEPS LOG [WORKLOAD [OPTIMIZER]]``
(SGD-momentum unless named; STEPS: where to stop, of the study's run).
"""
import sys

import torch

from experiments.screening import run_prefix
from gradcomp.compressors import TopK


def main(cap: float, stop: int, log: str, workload: str = "charlm-small", optimizer: str = "sgdm") -> None:
    torch.set_num_threads(1)
    compress = TopK.compress
    ratios = []

    def capped(self, tensor, residual=None, residual_out=None, backend=None):
        payload = compress(self, tensor, residual, residual_out, backend)
        if residual_out is None:
            return payload
        values, indices = payload["values"], payload["indices"].long()
        sent, allowed = float(values.float().norm()), cap * float(tensor.float().norm())
        ratios.append(sent / max(allowed / cap, 1e-30))
        if len(ratios) == 400:  # what the cap acts on: the sent norm over the gradient's, median of 400 groups
            print(f"screen_cap: sent / gradient norm, median of 400 groups {sorted(ratios)[200]:.3g}, "
                  f"max {max(ratios):.3g}", file=sys.stderr, flush=True)
            ratios.clear()
        if sent > allowed > 0:
            kept = values * (allowed / sent)
            residual_out.index_add_(0, indices, (values - kept).to(residual_out.dtype))
            values.copy_(kept)
        return payload

    TopK.compress = capped
    run_prefix(stop, log, workload, optimizer, "topk")


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]), sys.argv[3], *sys.argv[4:])
