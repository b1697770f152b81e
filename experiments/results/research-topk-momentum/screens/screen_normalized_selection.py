"""Top-k under SGD-momentum selecting in Adam-like units: each coordinate's ``|acc|`` over its own gradient RMS.

Under AdamW top-k selects in the frozen-variance stage's update units (``acc / sqrt(v)``) and ends within 1.4 % of
dense on every workload. Here SGD keeps its update (the recipe's, ``DelayedMomentumSGD``) and only the selection
changes: the group's ``k`` largest ``|acc_i| / r_i``, ``r_i`` coordinate ``i``'s gradient RMS over the dense start
(an exponential average of the averaged ``.grad`` squared, ``beta2 = 0.999`` as Adam's, bias-corrected, floored
at a tenth of its tensor's mean as the Adam stage's denominator), frozen at the first compressed step. The
values sent are ``acc`` itself (gradient units), so only which coordinates go changes.

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-topk-momentum/screens/screen_normalized_selection.py STEPS LOG
WORKLOAD``
"""
import sys

import torch

from experiments import loop as loops
from experiments.screening import recorded_engines, run_prefix, topk_by_score
from gradcomp.compressors import TopK
from gradcomp.engine import Engine


def main(stop: int, log: str, workload: str) -> None:
    torch.set_num_threads(1)
    engines = recorded_engines()
    squares, seen, frozen, current = {}, [0], {}, {}
    before_step, start, compress = loops.before_step, Engine.start, TopK.compress

    def observing(loop, model, optimizer, scaler=None):
        norm = before_step(loop, model, optimizer, scaler)
        if engines and engines[0].compressor_now() is None:  # the dense start: learn each coordinate's RMS
            seen[0] += 1
            for name, param in model.named_parameters():
                if param.grad is not None:
                    g2 = param.grad.detach().float().reshape(-1) ** 2
                    squares[name] = g2 * 0.001 if name not in squares else squares[name].mul_(0.999).add_(g2, alpha=0.001)
        return norm

    def rms(name):
        if name not in frozen:
            r = (squares[name] / (1 - 0.999 ** seen[0])).sqrt()
            frozen[name] = r.clamp(min=float(r.mean()) * 0.1 + 1e-30)
        return frozen[name]

    def starting(self, grad, keys, numels, group):
        current["keys"] = list(keys)
        return start(self, grad, keys, numels, group)

    def selecting(self, tensor, residual=None, residual_out=None, backend=None):
        keys = current.get("keys")
        if not keys or any(k.split("module.")[-1] not in squares and k not in squares for k in keys):
            return compress(self, tensor, residual, residual_out, backend)
        scale = torch.cat([rms(k if k in squares else k.split("module.")[-1]) for k in keys])
        if scale.numel() != tensor.numel():
            return compress(self, tensor, residual, residual_out, backend)
        return topk_by_score(self, tensor, residual, residual_out, lambda acc: acc.abs() / scale)

    loops.before_step, Engine.start, TopK.compress = observing, starting, selecting
    run_prefix(stop, log, workload, "sgdm", "topk")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
