"""Rank entry points and models for the multi-process DDP tests (real Gloo, no mocks).

Each worker is a top-level function that :func:`multiprocess.spawn` runs on every rank and
returns the rank's results.
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp.hooks import ddp as gc_ddp


# -- models and data ------------------------------------------------------------------------------
class ShuffledMLP(torch.nn.Module):
    """Parameters registered in a different order from the one backward reaches them,
    so DDP's bucket rebuild after iteration 1 changes the bucket layout."""

    def __init__(self, width=24):
        super().__init__()
        self.head = torch.nn.Linear(width, 3)
        self.middle = torch.nn.Linear(width, width)
        self.stem = torch.nn.Linear(8, width)

    def forward(self, x):
        return self.head(torch.tanh(self.middle(torch.tanh(self.stem(x)))))


def make_model(kind, seed=0):
    torch.manual_seed(seed)
    if kind == "shuffled":
        return ShuffledMLP()
    if kind == "mlp":
        return torch.nn.Sequential(
            torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3)
        )
    raise ValueError(kind)


def batch(rank, step, n=16):
    """Rank- and step-specific regression data (deterministic)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 8, generator=gen)
    y = torch.stack([x[:, 0] * x[:, 1], torch.sin(x[:, 2]), x[:, 3] - x[:, 4]], dim=1)
    return x, y


def local_gradients(model, rank, step):
    """The gradient one rank computes on its own batch, flat per parameter (by name)."""
    model.zero_grad()
    x, y = batch(rank, step)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


# -- workers ---------------------------------------------------------------------------------------
def make_compressor(spec):
    """``(name, argument or None)`` -> the compressor, through the registry by name (a string argument is
    the spec's arguments as written: ``"0.02,entries=compact"``)."""
    name, arg = spec
    return gradcomp.from_spec(name if arg is None else f"{name}:{arg if isinstance(arg, str) else repr(arg)}")


def train_and_record(rank, world_size, spec, steps, model_kind, state_kwargs, ddp_kwargs=None, lr=0.05):
    """Train with the gradcomp hook; record averaged gradients, params, bucket layouts
    (which parameters each bucket held at each step) and telemetry."""
    model = make_model(model_kind)
    ddp = DDP(model, **(ddp_kwargs or {}))
    state = gc_ddp.CompressionState(make_compressor(spec), named_parameters=model.named_parameters(), **state_kwargs)
    names = {id(p): name for name, p in model.named_parameters()}
    layouts = []

    def recording_hook(state, bucket):
        layouts.append((state.step, bucket.index(), tuple(names[id(p)] for p in bucket.parameters())))
        return gc_ddp.compression_hook(state, bucket)

    ddp.register_comm_hook(state, recording_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    grads, losses = [], []
    for step in range(steps):
        optimizer.zero_grad()
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        grads.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})
        losses.append(loss.item())
        optimizer.step()
    return {
        "grads": grads,
        "losses": losses,
        "params": {name: p.detach().clone() for name, p in model.named_parameters()},
        "layouts": layouts,
        "stats": state.stats(),
    }


def linear_batch(rank, step, n=32, noise=0.1):
    """Noisy linear regression, 32 -> 16: the loss floor is noise**2 = 0.01."""
    weights = torch.randn(32, 16, generator=torch.Generator().manual_seed(7)) / 32**0.5
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 32, generator=gen)
    return x, x @ weights + noise * torch.randn(n, 16, generator=gen)


def convergence(rank, world_size, steps, ratio, lr):
    """Held-out loss after training the same linear model dense, with TopK + error
    feedback, and with TopK alone (plain SGD)."""
    results = {}
    for label, spec, kwargs in (
        ("dense", ("identity", None), {}),
        ("topk_ef", ("topk", ratio), {"error_feedback": True}),
        ("topk_no_ef", ("topk", ratio), {"error_feedback": False}),
    ):
        torch.manual_seed(0)
        model = torch.nn.Linear(32, 16)
        ddp = DDP(model)
        gc_ddp.register(ddp, make_compressor(spec), warmup_steps=2, min_numel=0, **kwargs)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
        for step in range(steps):
            optimizer.zero_grad()
            x, y = linear_batch(rank, step)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
        x, y = linear_batch(rank=99, step=0, n=2048)
        with torch.no_grad():
            results[label] = torch.nn.functional.mse_loss(model(x), y).item()
    return results


def identity_vs_builtin(rank, world_size, steps):
    """Gradients of the Identity hook and of DDP's built-in allreduce, step by step."""
    runs = {}
    for label in ("builtin", "identity"):
        model = make_model("mlp")
        ddp = DDP(model)
        if label == "identity":
            gc_ddp.register(ddp, gradcomp.Identity(), warmup_steps=0, min_numel=0)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
        grads = []
        for step in range(steps):
            optimizer.zero_grad()
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            grads.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})
            optimizer.step()
        runs[label] = grads
    return runs


class SparseEmbeddingModel(torch.nn.Module):
    """Token ids ``[b, 4]`` -> ``[b, 32]``: an embedding with ``sparse=True`` (DDP buckets its gradient alone) and a
    linear head (2,080 parameters: compressed)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(60, 64, sparse=True)
        self.head = torch.nn.Linear(64, 32)

    def forward(self, tokens):
        return self.head(self.embedding(tokens).mean(dim=1))


def sparse_embedding_vs_builtin(rank, world_size, steps):
    """DDP's built-in reducer and the top-k recipe's hook on a model with a sparse gradient: every gradient per
    step (the embedding's densified), the parameters at the end, and how the recipe's groups travelled."""
    runs = {}
    for label in ("builtin", "recipe"):
        model = SparseEmbeddingModel()
        ddp = DDP(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        state = gc_ddp.register(ddp, "topk", optimizer=optimizer, total_steps=steps) if label == "recipe" else None
        grads, modes = [], []
        for step in range(steps):
            optimizer.zero_grad()
            generator = torch.Generator().manual_seed(100 * step + rank)
            tokens = torch.randint(0, 60, (16, 4), generator=generator)
            target = torch.randn(16, 32, generator=generator)
            torch.nn.functional.mse_loss(ddp(tokens), target).backward()
            grads.append({name: p.grad.to_dense().clone() if p.grad.is_sparse else p.grad.clone()
                          for name, p in model.named_parameters()})
            grads[-1]["embedding_is_sparse"] = model.embedding.weight.grad.is_sparse
            optimizer.step()
            if state is not None:
                modes.append({g: v["mode"] for g, v in state.stats()["last_step"]["groups"].items()})
        runs[label] = {"grads": grads, "modes": modes, "params": {n: p.detach().clone()
                                                                  for n, p in model.named_parameters()}}
    return runs


def count_collective_bytes(rank, world_size, steps):
    """Spy on the real collectives (they still run) to count the bytes handed to them,
    and compare with what the state reports."""
    import gradcomp.hooks.ddp as ddp_hook

    handed = []
    real_gather, real_reduce, real_send = ddp_hook._all_gather_flat, dist.all_reduce, dist.isend

    def gather(output, input, *args, **kwargs):
        handed[-1] += input.numel() * input.element_size()
        return real_gather(output, input, *args, **kwargs)

    def send(tensor, *args, **kwargs):  # the allgather over Gloo: one send to the one peer of 2 ranks
        handed[-1] += tensor.numel() * tensor.element_size()
        return real_send(tensor, *args, **kwargs)

    def reduce(tensor, *args, **kwargs):
        handed[-1] += tensor.numel() * tensor.element_size()
        return real_reduce(tensor, *args, **kwargs)

    ddp_hook._all_gather_flat, dist.all_reduce, dist.isend = gather, reduce, send
    try:
        model = make_model("mlp")
        ddp = DDP(model, bucket_cap_mb=0.01)
        # min_numel splits the buckets: the small one goes dense, the large ones compress.
        state = gc_ddp.register(ddp, gradcomp.TopK(0.05), warmup_steps=1, min_numel=1000)
        reported = []
        for step in range(steps):
            handed.append(0)
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            stats = state.stats()
            reported.append({"bytes_sent": stats["last_step"]["bytes_sent"],
                             "modes": sorted(b["mode"] for b in stats["last_step"]["groups"].values()),
                             "agreement": stats["agreement"]["collectives"]})
        return {"handed": handed, "reported": reported, "total": state.stats()["total"]["bytes_sent"],
                "buckets": len(stats["last_step"]["groups"])}
    finally:
        ddp_hook._all_gather_flat, dist.all_reduce, dist.isend = real_gather, real_reduce, real_send


def _spy_on_holds_and_collectives(names):
    """Wrap ``gradcomp.inflight.hold`` and the collectives ``names`` (attributes of
    ``torch.distributed`` and of ``gradcomp.hooks.ddp``; the real ones still run) to record the
    ``id`` of every alias ``hold`` returned and of every tensor handed to a collective. Returns
    ``(held, handed, restore)``."""
    from gradcomp import inflight

    held, handed, originals = set(), set(), []

    def recording_hold(*tensors):
        aliases = original_hold(*tensors)
        held.update(id(alias) for alias in aliases)
        return aliases

    def recording(collective):
        def call(*args, **kwargs):
            for arg in [*args, *kwargs.values()]:
                for tensor in (arg if isinstance(arg, (list, tuple)) else [arg]):
                    if isinstance(tensor, torch.Tensor):
                        handed.add(id(tensor))
            return collective(*args, **kwargs)
        return call

    original_hold = inflight.hold
    inflight.hold = recording_hold
    for module, name in names:
        originals.append((module, name, getattr(module, name)))
        setattr(module, name, recording(getattr(module, name)))

    def restore():
        inflight.hold = original_hold
        for module, name, original in originals:
            setattr(module, name, original)

    return held, handed, restore


def transport_holds(rank, world_size):
    """Run each collective of the DDP transport once and record whether every tensor it handed to
    Gloo is an alias that ``gradcomp.inflight.hold`` returned: ``{collective: (ids held, ids
    handed)}``, and whether everything was let go of at the end. The collectives are real."""
    from gradcomp import inflight

    names = [(dist, "all_reduce"), (dist, "all_to_all_single"), (dist, "all_gather"), (gc_ddp, "_all_gather_flat"),
             (dist, "isend"), (dist, "irecv")]
    held, handed, restore = _spy_on_holds_and_collectives(names)
    try:
        transport = gc_ddp.TorchDistributedTransport()

        def recorded():
            seen = (set(held), set(handed))
            held.clear()
            handed.clear()
            return seen

        report = {}
        transport.allgather(torch.full((16,), rank, dtype=torch.uint8), "g").wait()
        report["allgather"] = recorded()
        transport.allreduce_average(torch.ones(16), "r").wait()
        report["allreduce"] = recorded()
        transport.all_to_all(torch.arange(16, dtype=torch.uint8), "a")
        report["all_to_all"] = recorded()
        transport.agree(torch.tensor([rank, 7], dtype=torch.int64))
        report["agree"] = recorded()
        report["released"] = inflight.wait_until_released(timeout_s=10.0)
        return report
    finally:
        restore()


def gathers_hold(rank, world_size):
    """Gather every rank's gradcomp state the way a loop that saves one file does
    (``state.full_state_dict()``), spying on ``torch.distributed.all_gather`` (the real one still
    runs): ``(ids held, ids handed to Gloo)``, and whether every rank's state came back."""
    from gradcomp import inflight

    held, handed, restore = _spy_on_holds_and_collectives([(dist, "all_gather")])
    try:
        model = make_model("mlp")
        state = gc_ddp.register(DDP(model), gradcomp.TopK(0.05), warmup_steps=0, min_numel=0)
        full = state.full_state_dict()
        return {"held": set(held), "handed": set(handed), "ranks": len(full["ranks"]),
                "released": inflight.wait_until_released(timeout_s=10.0)}
    finally:
        restore()


def direct_allgathers(rank, world_size):
    """Gather payloads of every rank through the DDP transport on Gloo (``gradcomp.hooks.direct``), two groups in
    flight at once, spying on the real ``irecv``/``isend`` (they still run): ``{"gathered": what each returned, as
    lists, "posts": (kind, name of the thread that posted it) in order, "caller": the calling thread's name}``."""
    import threading

    posts, real = [], {"irecv": dist.irecv, "isend": dist.isend}

    def spy(kind):
        def call(*args, **kwargs):
            posts.append((kind, threading.current_thread().name))
            return real[kind](*args, **kwargs)

        return call

    dist.irecv, dist.isend = spy("irecv"), spy("isend")
    try:
        transport = gc_ddp.TorchDistributedTransport()
        first = transport.allgather(torch.arange(5, dtype=torch.uint8) + 10 * rank, "0")
        second = transport.allgather(torch.full((3,), 100 + rank, dtype=torch.uint8), "1")
        gathered = [second.wait()[0].tolist(), first.wait()[0].tolist()]
    finally:
        dist.irecv, dist.isend = real["irecv"], real["isend"]
    return {"gathered": gathered, "posts": posts, "caller": threading.current_thread().name}


def direct_allgather_with_a_departed_peer(rank, world_size):
    """Rank 1 leaves after a barrier without gathering (its process ends, its sockets close): what the
    transport's future raised on rank 0."""
    transport = gc_ddp.TorchDistributedTransport()
    dist.barrier()
    if rank == 1:
        return None
    try:
        transport.allgather(torch.zeros(8, dtype=torch.uint8), "0").wait()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"
