"""Rank workers and an independent single-process simulation for the optimizer-aware paths
(DGC momentum correction, CompressedAdamW) on real Gloo ranks.

Every parameter has a DDP bucket of its own (``bucket_cap_mb_list`` with a tiny cap: unlike
``bucket_cap_mb`` it also applies to a fresh DDP's first iteration, which torch 2.13 otherwise
runs as one bucket), so the simulation can follow each parameter alone, also right after a
resume. The simulation uses plain torch arithmetic written from the
algorithms' definitions (top-k by ``torch.topk``, the average as ``(D_0 + D_1) / 2`` in rank
order, the dense allreduce as ``g_0 / 2 + g_1 / 2``); it shares no code with the engine, the
hook, the transforms or the kernels. Elementwise formulas are written with the torch
primitives whose rounding the definitions imply (``torch.add(..., alpha=m)`` for ``g + m u``,
``lerp`` for ``b1 m + (1 - b1) g``, ``addcmul``/``addcdiv`` as in torch's AdamW), so that the
comparison can be bitwise.
"""
import io
import math

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp.hooks import ddp as gc_ddp
from gradcomp.optim import DGC, CompressedAdamW
from gradcomp.schedule import SparsityRamp

PER_PARAMETER_BUCKET_MB = 1e-6
MIN_NUMEL = 64  # the biases (< 64 entries) go dense: both paths are exercised
LR = 0.05
MOMENTUM = 0.9
DENSITY = 0.05


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 48), torch.nn.Tanh(), torch.nn.Linear(48, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 3))


def batch(rank, step, n=16):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 8, generator=gen)
    y = torch.stack([x[:, 0] * x[:, 1], torch.sin(x[:, 2]), x[:, 3] - x[:, 4]], dim=1)
    return x, y


def schedule_for(kind):
    # DGC: 2 dense steps, then 25% and 10% for 2 steps each, then 5%.
    # Adam: dense until the freeze at step 3, then the same ramp.
    dense = 2 if kind == "dgc" else 3
    return SparsityRamp(dense_steps=dense, stage_steps=2, densities=(0.25, 0.1))


# -- the product path ------------------------------------------------------------------------------
class Trainer:
    """DDP model + optimizer + gradcomp hook with the optimizer-aware transform."""

    def __init__(self, kind, compressor_spec=("topk", DENSITY)):
        self.kind = kind
        self.model = make_model()
        self.ddp = DDP(self.model, bucket_cap_mb_list=[PER_PARAMETER_BUCKET_MB])
        named = list(self.model.named_parameters())
        compressor = gradcomp.TopK(compressor_spec[1]) if compressor_spec[0] == "topk" else gradcomp.TwoBit("rms")
        if kind == "dgc":
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=0.0)
            transform = DGC(named, momentum=MOMENTUM, optimizer=self.optimizer)
        else:
            self.optimizer = CompressedAdamW(named, lr=1e-2, weight_decay=0.1, freeze_step=3)
            transform = self.optimizer.transform
        self.state = gc_ddp.register(self.ddp, compressor, schedule=schedule_for(kind), transform=transform,
                                     min_numel=MIN_NUMEL)

    def train(self, rank, steps, start=0):
        for step in range(start, start + steps):
            self.optimizer.zero_grad()
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(self.ddp(x), y).backward()
            self.optimizer.step()

    def checkpoint(self):
        buffer = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "gradcomp": self.state.state_dict()}, buffer)
        return buffer.getvalue()

    def restore(self, blob):
        saved = torch.load(io.BytesIO(blob), weights_only=True)
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.state.load_state_dict(saved["gradcomp"])

    def params(self):
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}


def train_worker(rank, world_size, kind, steps, compressor_spec=("topk", DENSITY)):
    trainer = Trainer(kind, compressor_spec)
    trainer.train(rank, steps)
    return {"params": trainer.params(), "stats": trainer.state.stats()["total"]}


def resume_worker(rank, world_size, kind, steps, split):
    """Train ``split`` steps, checkpoint, continue in a freshly built trainer from the checkpoint."""
    first = Trainer(kind)
    first.train(rank, split)
    blob = first.checkpoint()
    second = Trainer(kind)
    second.restore(blob)
    second.train(rank, steps - split, start=split)
    return {"params": second.params()}


# -- the independent simulation --------------------------------------------------------------------
def _local_grads(model, rank, step):
    model.zero_grad()
    x, y = batch(rank, step)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return {name: p.grad.detach().clone().reshape(-1) for name, p in model.named_parameters()}


def _density_at(step, kind):
    dense = 2 if kind == "dgc" else 3
    if step < dense:
        return None
    stage = (step - dense) // 2
    return (0.25, 0.1)[stage] if stage < 2 else DENSITY


def simulate(kind, steps, world_size=2, masking=True):
    """Parameters after ``steps`` steps of the algorithm, simulated in one process."""
    model = make_model()
    names = [name for name, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    velocity = {(r, k): torch.zeros(params[k].numel()) for r in range(world_size) for k in names}
    residual = {(r, k): torch.zeros(params[k].numel()) for r in range(world_size) for k in names}
    m_state = {k: torch.zeros_like(params[k]) for k in names}
    v_state = {k: torch.zeros_like(params[k]) for k in names}
    denom_state = {}
    beta1, beta2, eps, adam_lr, wd = 0.9, 0.999, 1e-8, 1e-2, 0.1
    for step in range(steps):
        grads = [_local_grads(model, r, step) for r in range(world_size)]
        density = _density_at(step, kind)
        frozen = kind == "adam" and step >= 3
        with torch.no_grad():
            for k in names:
                n = params[k].numel()
                if kind == "dgc":
                    sent_quantity = []
                    for r in range(world_size):
                        velocity[(r, k)] = torch.add(grads[r][k], velocity[(r, k)], alpha=MOMENTUM)
                        sent_quantity.append(velocity[(r, k)])
                elif frozen:
                    sent_quantity = [
                        torch.lerp(m_state[k].reshape(-1), grads[r][k], 1 - beta1) for r in range(world_size)
                    ]
                else:
                    sent_quantity = [grads[r][k] for r in range(world_size)]
                if density is None or n < MIN_NUMEL:
                    average = sent_quantity[0] * (1.0 / world_size)
                    for r in range(1, world_size):
                        average = average + sent_quantity[r] * (1.0 / world_size)
                else:
                    average = torch.zeros(n)
                    k_keep = min(n, max(1, math.ceil(density * n)))
                    for r in range(world_size):
                        acc = sent_quantity[r] + residual[(r, k)]
                        index = torch.topk(acc.abs(), k_keep).indices.sort().values
                        decoded = torch.zeros(n)
                        decoded[index] = acc[index]
                        residual[(r, k)] = acc - decoded
                        if kind == "dgc" and masking:
                            velocity[(r, k)][index] = 0.0
                        average += decoded
                    average = average / world_size
                param = params[k]
                if kind == "dgc":
                    param.add_(average.view_as(param), alpha=-LR)
                    continue
                t = step + 1
                average = average.view_as(param)
                if frozen:
                    m_state[k] = average.clone()
                    denom = denom_state[k]
                else:
                    m_state[k] = torch.lerp(m_state[k], average, 1 - beta1)
                    v_state[k] = torch.addcmul(v_state[k] * beta2, average, average, value=1 - beta2)
                    sqrt_v = v_state[k].sqrt() / math.sqrt(1 - beta2**t)
                    if t == 3:  # the freeze: floor at 0.1 x the tensor's mean sqrt(v_hat)
                        denom_state[k] = sqrt_v.clamp(min=float(sqrt_v.mean()) * 0.1) + eps
                    denom = sqrt_v + eps
                param.mul_(1 - adam_lr * wd)
                param.addcdiv_(m_state[k], denom, value=-adam_lr / (1 - beta1**t))
    return {name: p.detach().clone() for name, p in model.named_parameters()}
