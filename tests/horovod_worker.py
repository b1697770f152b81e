"""One Horovod rank of tests/test_horovod.py: every scenario in one ``horovodrun`` job.

Usage::

    horovodrun -np 2 --gloo -H localhost:2 python tests/horovod_worker.py OUT_DIR

Each rank writes ``OUT_DIR/rank{r}.pt`` (``torch.save`` of a dict, one entry per
scenario). The model, data and scenario settings are defined here once and imported
by the test, which re-derives the exact scenarios in a single process.
"""
import io
import os
import sys

import torch

import gradcomp

D_IN, HIDDEN, SAMPLES = 16, 64, 512
LR, MOMENTUM = 0.05, 0.9
WORLD_SIZE = 2

# Scenarios whose averaged gradients the test recomputes by hand, step by step.
# groups=1 compresses all parameters as one flat tensor (a global top-k).
EXACT = {
    "topk": dict(compressor=("topk", 0.01), steps=20, warmup_steps=2, min_numel=100, passes=1, groups=None),
    "twobit": dict(compressor=("twobit", 0.03), steps=20, warmup_steps=0, min_numel=100, passes=2, groups=None),
    "topk_global": dict(compressor=("topk", 0.01), steps=20, warmup_steps=0, min_numel=0, passes=1, groups=1),
    "topk_fp16": dict(compressor=("topk", 0.05), steps=10, warmup_steps=0, min_numel=0, passes=1, groups=None,
                      dtype=torch.float16),
    "bf16_allgather": dict(compressor=("bf16", None), steps=10, warmup_steps=0, min_numel=0, passes=1, groups=None),
}  # fmt: skip
CONVERGENCE_STEPS = 200
CHECKPOINT_AT = 10


def make_compressor(spec):
    """``(name, argument or None)`` -> the compressor, through the registry by name."""
    name, arg = spec
    return gradcomp.from_spec(name if arg is None else f"{name}:{arg!r}")


def make_model(dtype=torch.float32) -> torch.nn.Module:
    """The same initial weights on every rank and in the test process."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))
    return model.to(dtype)


def make_data(rank: int, dtype=torch.float32):
    """Rank ``rank``'s fixed regression data: a shared tanh teacher plus noise."""
    teacher = torch.randn(D_IN, 1, generator=torch.Generator().manual_seed(1234)) / D_IN**0.5
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(SAMPLES, D_IN, generator=generator)
    y = torch.tanh(2 * x @ teacher) + 0.3 * torch.randn(SAMPLES, 1, generator=generator)
    return x.to(dtype), y.to(dtype)


def backward_passes(model, data, passes: int) -> float:
    """``passes`` backward passes over equal slices of ``data`` (gradients accumulate);
    returns the mean loss."""
    x, y = data
    total = 0.0
    for xs, ys in zip(x.chunk(passes), y.chunk(passes)):
        loss = torch.nn.functional.mse_loss(model(xs).float(), ys.float())
        loss.backward()
        total += loss.item()
    return total / passes


def make_sgd(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def params_of(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# -- scenarios (run inside horovodrun) ----------------------------------------------------
def train(opt, model, data, steps, passes=1, record_grads=False):
    """``steps`` optimizer steps; optionally records the averaged gradients, read between
    ``synchronize()`` and a ``step()`` under ``skip_synchronize()``."""
    losses, grads = [], []
    for _ in range(steps):
        losses.append(backward_passes(model, data, passes))
        if record_grads:
            opt.synchronize()
            grads.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        opt.zero_grad()
    return losses, grads


def dropin(model, cfg=None, **kwargs):
    from gradcomp.hooks import horovod as gc_hvd

    if cfg is not None:
        kwargs = dict(
            compression=make_compressor(cfg["compressor"]),
            warmup_steps=cfg["warmup_steps"],
            min_numel=cfg["min_numel"],
            backward_passes_per_step=cfg["passes"],
            groups=cfg["groups"],
            **kwargs,
        )
    kwargs.setdefault("backend", "torch")  # the test's simulation follows the reference kernels
    return gc_hvd.DistributedOptimizer(make_sgd(model), named_parameters=model.named_parameters(), **kwargs)


def scenario_exact(rank, cfg):
    dtype = cfg.get("dtype", torch.float32)
    model = make_model(dtype)
    opt = dropin(model, cfg)
    losses, grads = train(opt, model, make_data(rank, dtype), cfg["steps"], cfg["passes"], record_grads=True)
    state = opt.compression_state_dict()
    return {
        "losses": losses,
        "grads": grads,
        "params": params_of(model),
        "residuals": state["residuals"],
        "stats": opt.stats(),
        "grad_dtypes": {name: g.dtype for name, g in grads[-1].items()},
    }


def scenario_checkpoint(rank):
    """``topk`` interrupted after CHECKPOINT_AT steps: save, rebuild everything from the
    checkpoint (through torch.save/torch.load(weights_only=True)), finish."""
    cfg = EXACT["topk"]
    data = make_data(rank)
    model = make_model()
    opt = dropin(model, cfg)
    train(opt, model, data, CHECKPOINT_AT)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)

    resumed = make_model()
    resumed.load_state_dict(checkpoint["model"])
    opt2 = dropin(resumed, cfg)
    opt2.load_state_dict(checkpoint["optimizer"])
    step_after_load = opt2.stats()["step"]
    train(opt2, resumed, data, cfg["steps"] - CHECKPOINT_AT)
    return {"params": params_of(resumed), "step_after_load": step_after_load}


def scenario_equivalence(rank, hvd):
    """The same 10 steps through Horovod's own optimizer and through the drop-in: dense
    (Identity, TopK(1.0) -- every entry, via allgather -- and the default compression)
    and fp16; hvd.broadcast_optimizer_state must not start an exchange."""
    from gradcomp.hooks import horovod as gc_hvd

    data = make_data(rank)
    results = {}
    makers = {
        "horovod": lambda m: hvd.DistributedOptimizer(make_sgd(m), named_parameters=m.named_parameters()),
        "identity": lambda m: dropin(m, compression=gradcomp.Identity()),
        "topk_all": lambda m: dropin(m, compression=gradcomp.TopK(1.0), min_numel=0, warmup_steps=0),
        "default": lambda m: gc_hvd.DistributedOptimizer(make_sgd(m), named_parameters=m.named_parameters()),
        "fp16_stock": lambda m: hvd.DistributedOptimizer(
            make_sgd(m), named_parameters=m.named_parameters(), compression=gc_hvd.Compression.fp16
        ),
        "fp16_dropin": lambda m: dropin(m, compression=gradcomp.FP16(), min_numel=0, warmup_steps=0),
    }
    for name, make in makers.items():
        model = make_model()
        opt = make(model)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        exchanged = opt.stats()["step"] if hasattr(opt, "stats") else None
        opt.zero_grad()
        losses, _ = train(opt, model, data, 10)
        results[name] = {"params": params_of(model), "losses": losses, "step_after_broadcast": exchanged}
        if hasattr(opt, "stats"):
            results[name]["modes"] = {k: v["mode"] for k, v in opt.stats()["last_step"]["groups"].items()}
    return results


class EmbeddingRegressor(torch.nn.Module):
    """A sparse embedding bag and a linear head: the embedding's gradient is sparse."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(50, 32, sparse=True)
        self.head = torch.nn.Linear(32, 1)

    def forward(self, tokens):
        return self.head(self.embedding(tokens).mean(dim=1))


def scenario_sparse(rank, hvd):
    """Sparse gradients: Horovod's own sparse allreduce, the drop-in's (the same calls),
    and the drop-in with sparse_as_dense=True, which compresses the densified gradient."""
    generator = torch.Generator().manual_seed(7 + rank)
    tokens = torch.randint(0, 50, (64, 4), generator=generator)
    target = torch.randn(64, 1, generator=generator)
    makers = {
        "horovod": lambda m, sgd: hvd.DistributedOptimizer(sgd, named_parameters=m.named_parameters()),
        "dropin": lambda m, sgd: dropin_with(m, sgd),
        "dropin_topk_dense": lambda m, sgd: dropin_with(
            m, sgd, compression=gradcomp.TopK(0.05), sparse_as_dense=True, min_numel=100
        ),
        # the recipe's default groups (DDP's buckets) with a sparse gradient in one: split at the first launch
        "dropin_recipe_topk": lambda m, sgd: dropin_with(m, sgd, compression=gradcomp.TopK(0.05), total_steps=10),
        # a group the user gave keeps Horovod's rule: one sparse gradient alone, or sparse_as_dense=True
        "dropin_groups": lambda m, sgd: dropin_with(m, sgd, compression=gradcomp.TopK(0.05),
                                                    groups=[list(m.parameters())]),
    }
    results = {}
    for name, make in makers.items():
        model = EmbeddingRegressor()
        opt = make(model, torch.optim.SGD(model.parameters(), lr=0.5))
        losses = []
        for _ in range(10):
            loss = torch.nn.functional.mse_loss(model(tokens), target)
            try:
                loss.backward()
                opt.synchronize()
            except ValueError as error:
                results[name] = {"error": str(error)}
                break
            losses.append(loss.item())
            sparse_after_sync = model.embedding.weight.grad.is_sparse
            with opt.skip_synchronize():
                opt.step()
            opt.zero_grad()
        if name in results:
            continue
        results[name] = {"params": params_of(model), "losses": losses, "sparse_after_sync": sparse_after_sync}
        if hasattr(opt, "stats"):
            results[name]["modes"] = {k: v["mode"] for k, v in opt.stats()["last_step"]["groups"].items()}
    return results


def dropin_with(model, sgd, **kwargs):
    from gradcomp.hooks import horovod as gc_hvd

    kwargs.setdefault("backend", "torch")
    return gc_hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), **kwargs)


def scenario_convergence(rank, hvd):
    """CONVERGENCE_STEPS full-batch steps: Horovod dense, Horovod + Compression.fp16,
    drop-in TopK(0.01) with error feedback."""
    from gradcomp.hooks import horovod as gc_hvd

    data = make_data(rank)
    makers = {
        "dense": lambda m: hvd.DistributedOptimizer(make_sgd(m), named_parameters=m.named_parameters()),
        "fp16": lambda m: hvd.DistributedOptimizer(
            make_sgd(m), named_parameters=m.named_parameters(), compression=gc_hvd.Compression.fp16
        ),
        "topk": lambda m: dropin(m, compression=gradcomp.TopK(0.01), min_numel=100),
    }
    results = {}
    for name, make in makers.items():
        model = make_model()
        opt = make(model)
        losses, _ = train(opt, model, data, CONVERGENCE_STEPS)
        results[name] = {"losses": losses, "params": params_of(model)}
        if hasattr(opt, "stats"):
            results[name]["stats"] = opt.stats()
    return results


def scenario_nonfinite(rank):
    """A NaN gradient on rank 1 only: every rank's average is non-finite and every
    rank's residuals stay as they were."""
    model = make_model()
    opt = dropin(model, compression=gradcomp.TopK(0.01), min_numel=100)
    data = make_data(rank)
    train(opt, model, data, 3)
    before = {k: v.clone() for k, v in opt.compression_state_dict()["residuals"].items()}
    x, y = data
    loss = torch.nn.functional.mse_loss(model(x), y)
    (loss * (float("nan") if rank == 1 else 1.0)).backward()
    opt.synchronize()
    after = opt.compression_state_dict()["residuals"]
    finite = {name: bool(torch.isfinite(p.grad).all()) for name, p in model.named_parameters()}
    unchanged = sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    opt.zero_grad()
    # Training goes on: the next step is finite again.
    losses, _ = train(opt, model, data, 1)
    return {
        "residual_keys": sorted(before),
        "unchanged": unchanged,
        "grad_finite": finite,
        "next_loss_finite": bool(torch.isfinite(torch.tensor(losses)).all()),
    }


def scenario_refused(rank, hvd):
    """A gradcomp compressor given to Horovod's own optimizer: every rank raises the same
    TypeError at its first compress call (inside the first backward), before any collective."""
    outcome = {}
    for name, compressor in {"topk": gradcomp.TopK(0.01), "fp16": gradcomp.FP16()}.items():
        model = make_model()
        opt = hvd.DistributedOptimizer(make_sgd(model), named_parameters=model.named_parameters(),
                                       compression=compressor)  # fmt: skip
        x, y = make_data(rank)
        try:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            outcome[name] = None
        except Exception as error:  # noqa: BLE001 - the test checks the type
            outcome[name] = (type(error).__name__, str(error))
    return outcome


def scenario_exchange_and_policy(rank, hvd):
    """The drop-in's exchange= and policy= (as on the DDP hook): two-phase and Auto train
    with ranks bitwise equal, and stats() shows the exchange that ran."""
    results = {}
    for name, kwargs in {"two_phase": dict(exchange="two_phase"), "auto": dict(policy=gradcomp.Auto())}.items():
        model = make_model()
        opt = dropin(model, compression=gradcomp.TopK(0.05), min_numel=0, warmup_steps=2, **kwargs)
        losses, _ = train(opt, model, make_data(rank), 6)
        modes = {group["mode"] for group in opt.stats()["last_step"]["groups"].values()}
        results[name] = {"losses": losses, "params": params_of(model), "modes": sorted(modes)}
    return results


def scenario_cross_path(rank, hvd):
    """One checkpoint format on both paths: the Horovod optimizer's gradcomp state loads into a
    DDP hook's state (over torch.distributed Gloo beside Horovod, same ranks) and back, through
    torch.save/torch.load(weights_only=True); both report stats() of one shape."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradcomp.hooks import ddp as gc_ddp

    def through_disk(state):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)

    from multiprocess import free_port

    port = free_port() if rank == 0 else None
    port = hvd.broadcast_object(port, root_rank=0, name="gradcomp.test.port")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        data = make_data(rank)
        settings = dict(compression=gradcomp.TopK(0.01), min_numel=100, warmup_steps=1)
        hvd_model = make_model()
        opt = dropin(hvd_model, **settings)
        train(opt, hvd_model, data, 4)
        from_horovod = through_disk(opt.state_dict()["gradcomp"])

        ddp_model = make_model()
        ddp = DDP(ddp_model)
        state = gc_ddp.register(ddp, settings["compression"], min_numel=100, warmup_steps=1, backend="torch")
        state.load_state_dict(from_horovod)
        loaded_in_ddp = state.state_dict()
        sgd = make_sgd(ddp_model)
        for _ in range(3):
            sgd.zero_grad()
            x, y = data
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            sgd.step()
        from_ddp = through_disk(state.state_dict())
        opt2 = dropin(make_model(), **settings)
        opt2.load_compression_state_dict(from_ddp)
        return {
            "from_horovod": from_horovod, "loaded_in_ddp": loaded_in_ddp,
            "from_ddp": from_ddp, "loaded_in_horovod": opt2.compression_state_dict(),
            "stats": {"horovod": opt.stats(), "ddp": state.stats()},
        }  # fmt: skip
    finally:
        dist.destroy_process_group()


def scenario_sum_reduction(rank, hvd):
    """op=hvd.Sum with each exchange of non-summable payloads: the gradients of one compressed step,
    beside those of op=hvd.Average from the same start."""
    results = {}
    for exchange in ("allgather", "two_phase"):
        results[exchange] = {}
        for op_name, op in (("Average", hvd.Average), ("Sum", hvd.Sum)):
            model = make_model()
            opt = dropin(model, compression=gradcomp.TopK(0.05), min_numel=0, warmup_steps=0, exchange=exchange, op=op)
            _, grads = train(opt, model, make_data(rank), 1, record_grads=True)
            results[exchange][op_name] = grads[0]
    return results


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    import horovod.torch as hvd

    hvd.init()
    rank = hvd.rank()
    assert hvd.size() == WORLD_SIZE, f"run with -np {WORLD_SIZE}, got {hvd.size()} ranks"
    results = {"exact": {name: scenario_exact(rank, cfg) for name, cfg in EXACT.items()}}
    results["checkpoint"] = scenario_checkpoint(rank)
    results["equivalence"] = scenario_equivalence(rank, hvd)
    results["sparse"] = scenario_sparse(rank, hvd)
    results["nonfinite"] = scenario_nonfinite(rank)
    results["convergence"] = scenario_convergence(rank, hvd)
    results["cross_path"] = scenario_cross_path(rank, hvd)
    results["refused"] = scenario_refused(rank, hvd)
    results["exchange_and_policy"] = scenario_exchange_and_policy(rank, hvd)
    results["sum_reduction"] = scenario_sum_reduction(rank, hvd)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    torch.save(results, path + ".tmp")
    os.replace(path + ".tmp", path)
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
