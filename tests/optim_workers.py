"""Rank workers and an independent single-process simulation of the recipe's optimizer paths on
real Gloo ranks: SGD with momentum on the compressed gradient (no stage), and the user's AdamW
with :class:`~gradcomp.optim.FrozenVarianceAdam` exchanging the gradient (each late gradient caught up on the steps
top-k compresses it) or each rank's first moment (its ``beta1`` shortened by error feedback's delay on those steps).

Every parameter has a DDP bucket of its own (``bucket_cap_mb_list`` with a tiny cap), so the
simulation can follow each parameter alone, also right after a resume. The simulation is plain
torch arithmetic written from the algorithms' definitions (top-k by ``torch.topk`` with error
feedback, the average as the rank-ordered sum of the decoded payloads / P, the dense allreduce as
``g_0 / 2 + g_1 / 2``, AdamW as torch writes it, the frozen step and its live level from their definitions);
it shares no code with the engine, the hook, the stage or the kernels, so that the comparison can be bitwise.
"""
import io
import math

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp.hooks import ddp as gc_ddp
from gradcomp.optim import FrozenVarianceAdam
from gradcomp.schedule import SparsityRamp

PER_PARAMETER_BUCKET_MB = 1e-6
MIN_NUMEL = 64  # the biases (< 64 entries) go dense: both paths are exercised
DENSITY = 0.05
SGD_LR, MOMENTUM = 0.05, 0.9
ADAM_LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.999), 1e-8
DENSE = 3  # dense steps (Adam's freeze), then 25% and 10% for 2 steps each, then 5%
KINDS = ("sgd", "adam-gradient", "adam-momentum")


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 48), torch.nn.Tanh(), torch.nn.Linear(48, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 3))


def batch(rank, step, n=16):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 8, generator=gen)
    y = torch.stack([x[:, 0] * x[:, 1], torch.sin(x[:, 2]), x[:, 3] - x[:, 4]], dim=1)
    return x, y


# -- the product path ------------------------------------------------------------------------------
class Trainer:
    """DDP model + optimizer + gradcomp hook, per ``kind`` of :data:`KINDS`."""

    def __init__(self, kind):
        self.model = make_model()
        self.ddp = DDP(self.model, bucket_cap_mb_list=[PER_PARAMETER_BUCKET_MB])
        transform = None
        if kind == "sgd":
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=SGD_LR, momentum=MOMENTUM)
        else:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=ADAM_LR, betas=BETAS, eps=EPS,
                                               weight_decay=WD)
            transform = FrozenVarianceAdam(self.optimizer, self.model.named_parameters(), freeze_step=DENSE,
                                           exchange=kind.split("-")[1])
        schedule = SparsityRamp(dense_steps=DENSE, stage_steps=2, densities=(0.25, 0.1))
        self.state = gc_ddp.register(self.ddp, gradcomp.TopK(DENSITY), schedule=schedule, transform=transform,
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


def train_worker(rank, world_size, kind, steps):
    trainer = Trainer(kind)
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


def _density_at(step):
    if step < DENSE:
        return None
    stage = (step - DENSE) // 2
    return (0.25, 0.1)[stage] if stage < 2 else DENSITY


def _shortened_beta1(density):
    """Adam's beta1 under top-k at ``density``: its mean delay ``b / (1 - b)`` less error feedback's, 5 steps at
    density 1/100, ``5 * log(1/density) / log(100)`` above it (the stage's rule, written from its definition)."""
    delay = 5.0 * min(1.0, math.log(1 / density) / math.log(1 / 0.01))
    left = max(0.0, BETAS[0] / (1.0 - BETAS[0]) - delay)
    return left / (1.0 + left)


def _exchange(sent, residuals, density, world_size):
    """The rank-ordered average of ``sent`` (one tensor per rank): dense, or top-k with error feedback."""
    n = sent[0].numel()
    if density is None or n < MIN_NUMEL:
        average = sent[0] * (1.0 / world_size)
        for r in range(1, world_size):
            average = average + sent[r] * (1.0 / world_size)
        return average
    average = torch.zeros(n)
    keep = min(n, max(1, math.ceil(density * n)))
    for r in range(world_size):
        acc = sent[r] + residuals[r]
        index = torch.topk(acc.abs(), keep).indices.sort().values
        decoded = torch.zeros(n)
        decoded[index] = acc[index]
        residuals[r] = acc - decoded
        average += decoded
    return average / world_size


class _Adam:
    """AdamW's state of one parameter, stepped as torch's single-tensor AdamW and, once frozen,
    as the frozen-variance step of its definition."""

    def __init__(self, param):
        self.m, self.v, self.t, self.denom = torch.zeros_like(param), torch.zeros_like(param), 0, None

    def freeze(self):
        sqrt_v = self.v.sqrt() / math.sqrt(1 - BETAS[1] ** DENSE)
        self.denom = sqrt_v.clamp(min=float(sqrt_v.mean()) * 0.1).add_(EPS)

    def step(self, param, grad, first_moment=False, factor=None, wait=None):
        """``grad`` times ``factor`` (the live level) is stepped on; with ``wait`` (int, the steps each coordinate
        waited, mutated) each late gradient is caught up: ``m`` takes ``c g``, the parameter ``(1 - c) g`` at once,
        ``c = (1 - b1^a) / ((1 - b1) a)`` for ``a`` = the wait + 1, which ends where ``grad`` is nonzero."""
        self.t += 1
        param.mul_(1 - ADAM_LR * WD)
        value = -ADAM_LR / (1 - BETAS[0] ** self.t)
        if self.denom is None:
            self.m.lerp_(grad, 1 - BETAS[0])
            self.v.mul_(BETAS[1]).addcmul_(grad, grad, value=1 - BETAS[1])
            denom = (self.v.sqrt() / ((1 - BETAS[1] ** self.t) ** 0.5)).add_(EPS)
        elif wait is not None:
            wait += 1
            age, base = wait.float(), torch.tensor(BETAS[0])
            c = torch.pow(base, age).neg().add(1.0).div(float(1 - base)).div(age).view_as(grad)
            self.m = torch.lerp(self.m, grad * c * factor, 1 - BETAS[0])
            param.addcdiv_(self.m, self.denom, value=value)
            param.addcdiv_(grad * (1 - c) * factor, self.denom, value=value)
            wait.mul_(grad.reshape(-1) == 0)
            return
        else:
            grad = grad if factor is None else grad * factor
            self.m = grad.clone() if first_moment else torch.lerp(self.m, grad, 1 - BETAS[0])
            denom = self.denom
        param.addcdiv_(self.m, denom, value=value)


def _level_factor(level, averages, denoms):
    """The gradient exchange's live level of the one param group (``level``: ``[n_0, n]``, mutated), from its
    definition: ``n = b2 n + (1 - b2) mean(g^2)`` over the group's averaged gradients, from ``n_0 = mean((d -
    eps)^2)`` of the frozen denominators; returns ``sqrt(n_0 / n)`` (float32 0-d)."""
    elements = sum(g.numel() for g in averages)
    if not level:
        level += [torch.stack([torch.linalg.vector_norm(d - EPS) for d in denoms]).square().sum() / elements] * 2
    squares = torch.stack([torch.linalg.vector_norm(g) for g in averages]).square().sum()
    level[1] = BETAS[1] * level[1] + (1 - BETAS[1]) * (squares / elements)
    return (level[0] / level[1]).sqrt()


def simulate(kind, steps, world_size=2):
    """Parameters after ``steps`` steps of ``kind``, simulated in one process."""
    model = make_model()
    params = dict(model.named_parameters())
    residual = {k: [torch.zeros(p.numel()) for _ in range(world_size)] for k, p in params.items()}
    moments = {k: [None] * world_size for k in params}
    adam = {k: _Adam(p) for k, p in params.items()}
    buffers = {k: None for k in params}
    waits = {k: None for k in params}  # adam-gradient under top-k: the steps each coordinate waited
    level = []
    for step in range(steps):
        grads = [_local_grads(model, r, step) for r in range(world_size)]
        averages = {}
        with torch.no_grad():
            for k, param in params.items():
                frozen = kind != "sgd" and step >= DENSE
                if frozen and adam[k].denom is None:
                    adam[k].freeze()
                sent = [grads[r][k] for r in range(world_size)]
                if frozen and kind == "adam-momentum":
                    start = [adam[k].m.reshape(-1) if moments[k][r] is None else moments[k][r]
                             for r in range(world_size)]
                    compressed = _density_at(step) is not None and param.numel() >= MIN_NUMEL
                    beta1 = _shortened_beta1(_density_at(step)) if compressed else BETAS[0]
                    sent = moments[k] = [torch.lerp(start[r], sent[r], 1 - beta1) for r in range(world_size)]
                if frozen:
                    sent = [s / adam[k].denom.reshape(-1) for s in sent]
                average = _exchange(sent, residual[k], _density_at(step), world_size)
                if frozen:
                    average = average * adam[k].denom.reshape(-1)
                averages[k] = average.view_as(param)
            frozen = kind != "sgd" and step >= DENSE
            factor = None  # the Adam stage's live level, with the gradient exchanged
            if frozen and kind == "adam-gradient":
                factor = _level_factor(level, list(averages.values()), [adam[k].denom for k in params])
            for k, param in params.items():
                if kind == "sgd":
                    grad = averages[k]
                    buffers[k] = grad.clone() if buffers[k] is None else buffers[k].mul_(MOMENTUM).add_(grad)
                    param.add_(buffers[k], alpha=-SGD_LR)
                    continue
                late = frozen and kind == "adam-gradient" and _density_at(step) is not None
                late = late and param.numel() >= MIN_NUMEL
                waits[k] = (waits[k] if waits[k] is not None else torch.zeros(param.numel(), dtype=torch.int32)) \
                    if late else None
                adam[k].step(param, averages[k], first_moment=frozen and kind == "adam-momentum", factor=factor,
                             wait=waits[k])
    return {name: p.detach().clone() for name, p in model.named_parameters()}
