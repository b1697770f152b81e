"""The drop-in ``DistributedOptimizer``: Horovod's optimizer protocol over :class:`gradcomp.engine.Engine`.

Same arguments, hooks, names and messages as ``hvd.DistributedOptimizer``; every exchange goes
through the engine: a backward hook starts a parameter's (or group's) exchange as soon as its
gradient is ready, and ``synchronize()`` finishes them all.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Dict, List, Optional

import horovod.torch as hvd
import torch
from horovod.torch import mpi_ops as _hvd_mpi_ops
from horovod.torch import optimizer as _hvd_optimizer
from horovod.torch.mpi_ops import Average, Sum, global_process_set

from gradcomp.engine import Engine, Handle
from gradcomp.error_feedback import ErrorFeedback
from gradcomp.exchanges import DEFAULT as DEFAULT_EXCHANGE
from gradcomp.exchanges.sparse import FrameworkSparse
from gradcomp.hooks.horovod.compression import Compression, as_compressor
from gradcomp.hooks.horovod.parameters import (
    Unit,
    build_units,
    check_horovod_arguments,
    ddp_buckets,
    flatten,
    names_of,
    op_name,
    unflatten,
)
from gradcomp.hooks.horovod.transport import HorovodTransport
from gradcomp.settings import DEFAULT_MIN_NUMEL
from gradcomp.setup import prepare, speaks_to_caller

__all__ = ["DistributedOptimizer"]


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods copied into a subclass of the wrapped optimizer's class, as Horovod does
    (``super(self.__class__, self)`` is the wrapped class). Build it with :func:`DistributedOptimizer`."""

    def __init__(self, params, named_parameters, engine: Engine, backward_passes_per_step, op, groups,
                 sparse_as_dense, process_set):
        super(self.__class__, self).__init__(params)
        self.engine, self.op, self.process_set = engine, op, process_set
        self.backward_passes_per_step, self.sparse_as_dense = backward_passes_per_step, sparse_as_dense
        self._parameter_names = names_of(self.param_groups, named_parameters)
        self._units: List[Unit] = build_units(self.param_groups, self._parameter_names, groups, process_set)
        self._unit_of = {p: u for u in self._units for p in u.params}
        self._allreduce_delay = {p: backward_passes_per_step for p in self._unit_of}
        self._ready_count: Dict[Unit, int] = {u: 0 for u in self._units}
        self._handles: Dict[Unit, Optional[tuple]] = {}  # unit -> exchange in flight (None: waiting)
        self._synchronized, self._should_synchronize = False, True
        self.splits_sparse = False  # set by DistributedOptimizer where it chose the groups
        if self.process_set.included():
            # Units change only by a split every rank makes alike (_split_sparse): one check covers every step.
            engine.check_agreement([(u.numels, u.params[0].dtype) for u in self._units], "construction")
            for unit in self._units:
                for p in unit.params:
                    p.register_post_accumulate_grad_hook(self._make_hook(p))

    def _make_hook(self, p):
        # The post-accumulate-grad hook is torch's public form of the hook Horovod puts on
        # each parameter's AccumulateGrad node: it fires once p.grad holds this pass's sum.
        def hook(*ignore):
            if self._allreduce_delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before call "
                    "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
            self._allreduce_delay[p] -= 1
            unit = self._unit_of[p]
            if self._allreduce_delay[p] == 0:
                self._ready_count[unit] += 1
                if self._ready_count[unit] == len(unit.params):
                    self._launch_ready(unit)
                    return
            self._handles.setdefault(unit, None)

        return hook

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _launch_ready(self, unit: Unit) -> None:
        """Start ``unit``'s exchange once its gradients are in. A default group (``splits_sparse``) that meets a
        sparse gradient is split first (:meth:`_split_sparse`); a group the user gave keeps Horovod's rule."""
        self._handles.pop(unit, None)
        splits = self.splits_sparse and len(unit.params) > 1 and not self.sparse_as_dense
        sparse = [p for p in unit.params if p.grad is not None and p.grad.is_sparse] if splits else []
        for part in self._split_sparse(unit, sparse) if sparse else [unit]:
            self._handles[part] = self._launch(part)

    def _split_sparse(self, unit: Unit, sparse: List[torch.nn.Parameter]) -> List[Unit]:
        """Replace ``unit``, for good, by each of its ``sparse`` gradients' parameters alone and the rest as one
        group, in its place: DDP's buckets hold a sparse gradient alone, and Horovod's sparse allreduce takes one
        tensor. Every rank meets the same sparse gradients (one model), so every rank splits alike."""
        rest = [p for p in unit.params if not any(p is q for q in sparse)]
        parts = [Unit([p], [self._parameter_names[p]]) for p in sparse]
        parts += [Unit(rest, [self._parameter_names[p] for p in rest])] if rest else []
        at = self._units.index(unit)
        self._units[at:at + 1] = parts
        del self._ready_count[unit]
        for part in parts:
            self._ready_count[part] = len(part.params)
            self._unit_of.update(dict.fromkeys(part.params, part))
        return parts

    def _launch(self, unit: Unit) -> tuple:
        """Start ``unit``'s exchange: ``(handle or Horovod sparse handle, flat_is_grad, resparsify)``."""
        resparsify = []
        for p in unit.params:
            if p.grad is None:  # not computed here, maybe on another rank: every rank must send
                p.grad = p.data.new(p.size()).zero_()
            if p.grad.is_sparse and self.sparse_as_dense:
                p.grad = p.grad.to_dense()
                resparsify.append(p)
        grads = [p.grad for p in unit.params]
        if any(g.is_sparse for g in grads):
            if len(grads) > 1:
                raise ValueError(f"group {unit.name} has sparse gradients; pass sparse_as_dense=True")
            work = _hvd_mpi_ops.sparse_allreduce_async(grads[0], name=unit.name, op=self.op,
                                                       process_set=self.process_set)  # fmt: skip
            FrameworkSparse.record(self.engine.telemetry.record, unit.name, grads[0])
            return work, False, resparsify
        flat, flat_is_grad = flatten(grads)
        return self.engine.start(flat, unit.names, unit.numels, unit.name), flat_is_grad, resparsify

    def _finish(self, unit: Unit, exchange: tuple) -> None:
        handle, flat_is_grad, resparsify = exchange
        grads = [p.grad for p in unit.params]
        if not isinstance(handle, Handle):  # a sparse allreduce
            grads[0].zero_().add_(handle())
            return
        flat = self.engine.finish(handle, hvd.synchronize(handle.work))
        if self.op == Sum and handle.exchange.averages_itself:
            flat.mul_(self.process_set.size())  # the exchange averaged; exact for power-of-two sizes
        if not flat_is_grad:
            unflatten(flat, grads)
        for p in resparsify:
            p.grad = p.grad.to_sparse()

    def synchronize(self) -> None:
        """Finish every gradient's exchange and write the averages into ``p.grad``."""
        if not self.process_set.included():
            self._synchronized = True
            return
        for unit in list(self._units):  # a launch may split a unit (_split_sparse)
            if self._handles.get(unit) is None:  # step() before backward_passes_per_step passes, or unused
                self._launch_ready(unit)
        for unit, exchange in self._handles.items():
            self._finish(unit, exchange)
        self._handles.clear()
        self.set_backward_passes_per_step(self.backward_passes_per_step)
        self._ready_count = dict.fromkeys(self._ready_count, 0)
        self.engine.end_step()
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """``step()`` inside this context does not synchronize (call ``synchronize()`` first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to "
                    "consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        transform = self.engine.transform
        staged = callable(getattr(transform, "before_optimizer_step", None))
        if staged:  # an optimizer stage that needs the averaged gradients (FrozenVarianceAdam)
            transform.before_optimizer_step()
        loss = super(self.__class__, self).step(closure)
        if staged:
            transform.after_optimizer_step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        if self._handles:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                "or optimizer.synchronize(). This is prohibited as it can cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none)

    # -- checkpointing and telemetry: the engine's, the same as the DDP hook's ---------------
    def state_dict(self):
        """The wrapped optimizer's state dict plus ``"gradcomp"``: :meth:`compression_state_dict`."""
        state = super(self.__class__, self).state_dict()
        state["gradcomp"] = self.compression_state_dict()
        return state

    def load_state_dict(self, state_dict, unknown_residuals: str = "raise"):
        """Validate gradcomp's part and the wrapped optimizer's, then load both: a rejected
        checkpoint changes neither. gradcomp's part is validated whole before anything is assigned
        (its assignment cannot fail); the wrapped optimizer's load checks its groups before it
        changes anything (torch's), and one with ``check_state_dict`` is
        checked first as well."""
        state_dict = dict(state_dict)
        compression_state = state_dict.pop("gradcomp", None)
        check = getattr(super(self.__class__, self), "check_state_dict", None)
        if callable(check):
            check(state_dict)
        assign = None if compression_state is None else self._prepare_load(compression_state, unknown_residuals)
        super(self.__class__, self).load_state_dict(state_dict)
        self._handles, self._synchronized, self._should_synchronize = {}, False, True
        self.set_backward_passes_per_step(self.backward_passes_per_step)
        self._ready_count = dict.fromkeys(self._ready_count, 0)
        if assign is not None:
            assign()

    def compression_state_dict(self) -> dict:
        """This rank's :meth:`gradcomp.engine.Engine.state_dict` (also what the DDP hook saves)."""
        return self.engine.state_dict()

    def load_compression_state_dict(self, state: dict, unknown_residuals: str = "raise") -> None:
        """Restore :meth:`compression_state_dict` (from this optimizer or the DDP hook) transactionally."""
        self._prepare_load(state, unknown_residuals)()

    def _prepare_load(self, state: dict, unknown_residuals: str):
        numels = {name: n for u in self._units for name, n in zip(u.names, u.numels)}
        return self.engine.prepare_load(state, numels, unknown_residuals)

    def stats(self) -> dict:
        """See :meth:`gradcomp.telemetry.Telemetry.stats` (groups are parameter names)."""
        return self.engine.stats()

    @property
    def residual_memory(self) -> ErrorFeedback:
        """This rank's error-feedback memory, keyed by parameter name."""
        return self.engine.residual_memory


@speaks_to_caller
def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step: int = 1, op=Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups=None, sparse_as_dense: bool = False,
                         process_set=global_process_set, warmup_steps: Optional[int] = None,
                         min_numel: int = DEFAULT_MIN_NUMEL, error_feedback: bool = True, backend: Optional[str] = None,
                         schedule=None, transform=None, exchange: str = DEFAULT_EXCHANGE, policy=None,
                         total_steps: Optional[int] = None, scheduler=None,
                         min_compression: Optional[float] = None, granularity: Optional[str] = None,
                         grad_scaler=None, residual_decay: Optional[float] = None):  # fmt: skip
    """``hvd.DistributedOptimizer`` that also takes ``TopK`` and ``TwoBit``.

    The first ten arguments are Horovod's, with Horovod's meaning; ``compression`` is a gradcomp
    compressor instance or a Horovod compression class. The rest are the engine's, with the same
    meaning as on the DDP hook's :class:`~gradcomp.hooks.ddp.CompressionState`
    (:class:`gradcomp.engine.Engine`; defaults in :mod:`gradcomp.settings`): ``exchange`` names one
    of :mod:`gradcomp.exchanges` (``names(selectable=True)``; all-to-alls go over ``hvd.alltoall``), and
    ``policy`` a per-group choice of method such as :class:`gradcomp.Auto`. Each parameter (or
    group of ``groups``, compressed as one flat tensor) is compressed with error feedback keyed
    by its name once backward has run ``backward_passes_per_step`` times, its payload allgathered
    (summable payloads: allreduced), and ``synchronize()`` writes the rank-ordered float32
    average into ``p.grad``. ``op=hvd.Sum`` gives the average times the world size.

    ``total_steps=`` (with ``scheduler=`` and ``min_compression=`` optional) applies the one-call
    recipe of :mod:`gradcomp.recipe` to the wrapped ``optimizer``, exactly as
    ``gradcomp.register`` does on DDP: the same set-up (:func:`gradcomp.setup.prepare`), the same
    rules and checks, the same parameter names (wrapper prefixes removed); ``.recipe`` on the
    returned optimizer says what was chosen. ``granularity``, ``grad_scaler`` and ``residual_decay`` are
    the engine's (``None``: the recipe's choice, else the engine's default); the recipe's ``groups`` default is DDP's.

    Example::
        >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
        ...                            named_parameters=model.named_parameters(),
        ...                            compression=gradcomp.TopK(0.01), warmup_steps=5)
    """
    compressor = as_compressor(compression)
    groups = check_horovod_arguments(num_groups, groups, backward_passes_per_step, op, gradient_predivide_factor)
    unset = {"granularity": granularity, "residual_decay": residual_decay}  # None: the recipe's (or engine's) choice
    engine_settings = dict(warmup_steps=warmup_steps, min_numel=min_numel, error_feedback=error_feedback,
                           backend=backend, schedule=schedule, transform=transform, exchange=exchange, policy=policy,
                           grad_scaler=grad_scaler, **{k: v for k, v in unset.items() if v is not None})
    if compressor is None or (op not in (Average, Sum) and compressor.summable):
        if total_steps is not None:
            raise ValueError(f"the recipe (total_steps=) is for gradcomp's compressors; {compression!r} needs none")
        _warn_unused(engine_settings)
        horovod_compression = compression if compressor is None else Compression.wrap(compressor)
        return hvd.DistributedOptimizer(optimizer, named_parameters, horovod_compression, backward_passes_per_step,
                                        op, gradient_predivide_factor, 0, groups, sparse_as_dense, process_set)
    _check_drop_in_arguments(compressor, op, named_parameters, error_feedback)
    named = list(names_of(optimizer.param_groups, named_parameters).items())
    setup = prepare(compressor, [(name, p) for p, name in named],
                    optimizer=optimizer if total_steps is not None else None, total_steps=total_steps,
                    scheduler=scheduler, min_compression=min_compression, stage_hook=False,
                    announce=_first_rank(process_set), **engine_settings)
    engine = Engine(setup.compressor, HorovodTransport(process_set, op, gradient_predivide_factor), **setup.settings)
    engine.agreement_steps = ()  # checked once at construction instead
    chosen = _recipe_groups(groups, total_steps, named)
    distributed = _drop_in(optimizer, setup.named, engine, backward_passes_per_step, op, chosen, sparse_as_dense,
                           process_set)
    distributed.splits_sparse, distributed.recipe = chosen is not groups, setup.recipe
    return distributed


def _recipe_groups(groups, total_steps: Optional[int], named) -> Optional[list]:
    """``groups`` as given; with the recipe (``total_steps``) and none given, DDP's buckets of ``named``'s
    parameters (:func:`~gradcomp.hooks.horovod.parameters.ddp_buckets`), not one parameter at a time: per
    parameter the engine's fixed work is paid once a tensor (top-k on charlm-small 1.23x dense's step on the
    loopback), and the recipe's rules were made on DDP's buckets."""
    if total_steps is None or groups is not None:
        return groups
    return ddp_buckets([p for p, _ in named if p.requires_grad])


def _first_rank(process_set) -> bool:
    """Whether this process speaks for the process set (its rank 0); before ``hvd.init()`` (argument
    checks in one process) it does."""
    try:
        return process_set.included() and process_set.rank() == 0
    except ValueError:
        return True


def _drop_in(optimizer, named_parameters, engine: Engine, *args) -> torch.optim.Optimizer:
    """``optimizer``'s class with :class:`_DistributedOptimizer`'s methods, over its param groups and
    state, exchanging through ``engine``; ``args`` are the rest of that class's arguments."""
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    # hvd.broadcast_optimizer_state recognises a distributed optimizer by its module and then
    # initialises state with the wrapped class's step() instead of ours, which would start an
    # exchange. Claim Horovod's module so that it treats this one the same way.
    cls.__module__ = _hvd_optimizer.DistributedOptimizer.__module__
    distributed = cls(optimizer.param_groups, named_parameters, engine, *args)
    distributed.state.update(optimizer.state)  # keep what the wrapped optimizer accumulated
    transform = engine.transform
    if transform is not None and callable(getattr(transform, "before_optimizer_step", None)):
        transform.optimizer = distributed  # the stage reads the state of the optimizer the user steps
    return distributed


def _check_drop_in_arguments(compressor, op, named_parameters, error_feedback: bool) -> None:
    """Raise ``ValueError`` for a reduction op or missing names the drop-in cannot work with."""
    if op not in (Average, Sum):
        raise ValueError(
            f"op={op_name(op)} cannot combine {compressor!r} payloads: each rank's payload is decoded and the "
            "results are averaged (op=hvd.Average) or summed (op=hvd.Sum). Use one of those, or a "
            "summable compression with hvd.DistributedOptimizer for other ops.")
    if named_parameters is None and error_feedback and compressor.uses_error_feedback:
        raise ValueError(
            f"{compressor!r} keeps error-feedback residuals keyed by parameter name, so that they are "
            "saved and restored by name; pass named_parameters=model.named_parameters() (or error_feedback=False).")


def _warn_unused(engine_settings: dict) -> None:
    """Warn about the engine's settings that differ from their defaults when Horovod's own optimizer runs."""
    defaults = dict(warmup_steps=None, min_numel=DEFAULT_MIN_NUMEL, error_feedback=True, backend=None,
                    schedule=None, transform=None, exchange=DEFAULT_EXCHANGE, policy=None, granularity=None,
                    grad_scaler=None, residual_decay=None)
    changed = sorted(k for k, v in engine_settings.items() if v is not defaults[k] and v != defaults[k])
    if changed:
        warnings.warn(f"gradcomp: {changed} have no effect when hvd.DistributedOptimizer does the exchange")
