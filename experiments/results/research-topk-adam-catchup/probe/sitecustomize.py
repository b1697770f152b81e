"""Probes of the top-k recipe under Adam/AdamW, loaded into every run's process through ``PYTHONPATH``.

Not gradcomp: each variable changes one thing of the recipe's ``FrozenVarianceAdam`` for a research run (the
README beside this directory), and nothing when unset::

    GC_TOPK_LEVEL=1   the live level per param group on top-k's momentum exchange too (the recipe: off there)
    GC_TOPK_DELAY=X   the delay the first moment gives up on a compressed step set to X steps (recipe: the law's)
    GC_TOPK_CATCHUP=1 top-k under Adam exchanges the gradient (beta1 whole, the live level on as with 2-bit), and each
                      coordinate's late gradient is caught up as Adam's first moment would have applied it on time:
                      DelayedMomentumSGD's catch-up in the frozen update (c of its wait into exp_avg, (1 - c) of the
                      burst onto the parameter at once); GC_TOPK_NOLEVEL=1: without the live level;
                      GC_TOPK_NOGUARD=1: without the spike guard
"""
import os

if os.environ.get("GC_TOPK_LEVEL") or os.environ.get("GC_TOPK_DELAY") or os.environ.get("GC_TOPK_CATCHUP"):
    from gradcomp.optim import frozen_adam

    _init = frozen_adam.FrozenVarianceAdam.__init__

    def _probe_init(self, *args, **kwargs):
        if kwargs.get("exchange") == "momentum":
            if os.environ.get("GC_TOPK_LEVEL"):
                kwargs["live_level"] = True
            if os.environ.get("GC_TOPK_CATCHUP"):
                kwargs["exchange"] = "gradient"
                kwargs["live_level"] = not os.environ.get("GC_TOPK_NOLEVEL")
                kwargs["spike_guard"] = not os.environ.get("GC_TOPK_NOGUARD")
            if os.environ.get("GC_TOPK_DELAY"):
                kwargs["delay_steps"] = float(os.environ["GC_TOPK_DELAY"])
        _init(self, *args, **kwargs)

    frozen_adam.FrozenVarianceAdam.__init__ = _probe_init

if os.environ.get("GC_TOPK_CATCHUP"):
    import torch

    from gradcomp.optim.delayed_momentum import share_table
    from gradcomp.optim.spike_guard import scaled

    _update = frozen_adam.frozen_update
    _waits = {}

    @torch.no_grad()
    def _catchup_update(params, exp_avgs, grads, denoms, steps, group, decoupled, exchange, bounded, factor=None):
        beta1, lr = group["betas"][0], float(group["lr"])
        r = scaled(grads, factor)
        table = share_table(beta1, params[0].device)
        waits, shares = [], []
        for param in params:
            wait = _waits.get(id(param))
            if wait is None:
                wait = _waits[id(param)] = torch.zeros(param.shape, dtype=torch.int16, device=param.device)
            wait.add_(1).clamp_max_(30000)
            waits.append(wait)
            shares.append(table.index_select(0, wait.view(-1).int()).view(wait.shape))
        _update(params, exp_avgs, torch._foreach_mul(r, shares), denoms, steps, group, decoupled, exchange, bounded,
                None)
        for param, r_i, c, denom, t, wait in zip(params, r, shares, denoms, steps, waits):
            param.addcdiv_(r_i * (1 - c), denom, value=-lr / (1 - beta1 ** t))
            wait.mul_(r_i == 0)

    frozen_adam.frozen_update = _catchup_update
