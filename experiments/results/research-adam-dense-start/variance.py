"""Dense AdamW on one process, the study's loop of ``WORKLOAD`` for its first ``SHOW`` steps: the training loss and
the mean of Adam's bias-corrected ``sqrt(v)`` over every element, with its ratio to five steps before.

Usage, from the repository root: ``PYTHONPATH=. python experiments/results/research-adam-dense-start/variance.py
WORKLOAD STEPS SHOW`` (``STEPS``: the run the loop is planned for).
"""
import sys

import torch

from experiments import loop as loops
from experiments import suite

torch.set_num_threads(1)
w, steps = sys.argv[1], int(sys.argv[2])
wl = suite.build(w, 0, 32)
model = wl.build_model()
loop = loops.loop_for(w, "adamw", steps)
opt, sched = loops.build_optimizer(loop, model)
hist = []
for step in range(min(steps, int(sys.argv[3]))):
    if loop.manual_lr:
        loops.set_lr(loop, opt, step)
    x, y = wl.batch(0, step, wl.default_batch_size)
    loss = wl.loss(model, x, y)
    loss.backward()
    if loop.clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), loop.clip)
    opt.step()
    opt.zero_grad()
    if sched:
        sched.step()
    b2 = opt.param_groups[0]["betas"][1]
    num = den = 0.0
    for g in opt.param_groups:
        for p in g["params"]:
            st = opt.state[p]
            t = int(st["step"])
            vhat = st["exp_avg_sq"] / (1 - b2 ** t)
            num += float(vhat.sqrt().sum())
            den += p.numel()
    hist.append((step, float(loss.detach()), num / den, opt.param_groups[0]["lr"]))
for i, (s, value, m, lr) in enumerate(hist):
    prev = hist[i - 5][2] if i >= 5 else float("nan")
    if s % 2 == 0 or s < 12:
        print(f"{w} step {s:3d} loss {value:.3f} lr {lr:.2e} mean sqrt(vhat) {m:.3e} ratio5 {m / prev:.3f}")
