"""Rank entry points for tests/test_torch_compile.py: the recipe loop on an eager, a compiled-inside
(``DDP(torch.compile(net))``) and a compiled-outside (``torch.compile(DDP(net))``) model."""
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_workers as workers
import framework_workers as fw
import gradcomp

MODES = ("eager", "compiled_module", "compiled_ddp")


def wrap(net, mode: str, backend: str):
    """``net`` in DDP as ``mode`` says; returns ``(model to call, DDP model)``."""
    if mode == "eager":
        ddp = DDP(net)
        return ddp, ddp
    if mode == "compiled_module":
        ddp = DDP(torch.compile(net, backend=backend))
        return ddp, ddp
    if mode == "compiled_ddp":
        ddp = DDP(net)
        return torch.compile(ddp, backend=backend), ddp
    raise ValueError(mode)


def recipe_loop(rank, world_size, spec, steps, mode, backend="inductor", compiled_autograd=False):
    """The recipe (AdamW, warm-up, clipping) on ``mode``'s model, registered on what the user holds
    (the compiled DDP model itself for ``compiled_ddp``); the engine's totals count the hook's steps."""
    torch._dynamo.reset()
    torch._dynamo.config.compiled_autograd = compiled_autograd
    net = workers.make_model("mlp")
    model, ddp = wrap(net, mode, backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=fw.RECIPE_LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, fw.warmup)
    state = gradcomp.register(model, spec, optimizer=optimizer, scheduler=scheduler, **fw.recipe_kwargs(steps))
    for step in range(steps):
        x, y = workers.batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), fw.CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return fw.result(net, state)


def python_reducer_refused(rank, world_size):
    """``register`` on a DDP model built under ``optimize_ddp="python_reducer"``: its error message."""
    torch._dynamo.config.optimize_ddp = "python_reducer"
    try:
        ddp = DDP(workers.make_model("mlp"))
        gradcomp.register(ddp, "topk:0.1")
    except RuntimeError as error:
        return str(error)
    finally:
        torch._dynamo.config.optimize_ddp = True
    return None
