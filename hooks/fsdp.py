"""FSDP2's reduce-scatter through gradcomp: a thin adapter from ``fully_shard``'s modules to the engine.

torch's FSDP2 (``torch.distributed.fsdp.fully_shard``) reduce-scatters each module's gradients once per
backward through a ``ReduceScatter`` object that ``FSDPModule.set_custom_reduce_scatter`` replaces.
:func:`register` installs one on every FSDP module of a model. Each call hands FSDP's input (the
module's unsharded gradients laid out as ``P`` rows, row ``j`` for rank ``j``) to the engine as one
group, keyed by each parameter's piece of each row; the engine runs its step (schedule, error feedback
on the whole unsharded gradient, compression, validation, the commit rule, telemetry) through the
scattering exchanges of :mod:`gradcomp.exchanges.reduce_scatter`, and this rank's row of the average
becomes FSDP's output. FSDP then gives each rank its shard of ``.grad``, the average gradient in
gradient units, as its own reduce-scatter does, so ``clip_grad_norm_`` on the DTensors and the sharded
optimizer behave as without gradcomp.

Example::

    >>> for block in model.blocks:
    ...     fully_shard(block)
    >>> fully_shard(model)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    >>> state = gradcomp.hooks.fsdp.register(model, "topk:0.01", optimizer=optimizer, total_steps=steps)
    >>> # ... train as usual; dcp.save({"model": ..., "optim": ..., "gradcomp": state}, checkpoint_id=...)
"""
from __future__ import annotations

import logging
import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from gradcomp import inflight
from gradcomp.compact_residuals import CompactResiduals
from gradcomp.engine import Engine
from gradcomp.exchanges.reduce_scatter import CompressedReduceScatter, dense_below, piece_key
from gradcomp.hooks.ddp import TorchDistributedTransport
from gradcomp.hooks.fsdp_checkpoint import dcp_state_dict, engine_state_dict
from gradcomp.settings import DEFAULT_MIN_NUMEL
from gradcomp.setup import prepare, speaks_to_caller

__all__ = ["FSDPCompressionState", "GradcompReduceScatter", "FSDPTransport", "register"]

logger = logging.getLogger(__name__)

# torch 2.13 names it reduce_scatter_single; FSDP's own reduce-scatter calls the same collective.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class FSDPTransport(TorchDistributedTransport):
    """The collectives over FSDP's shard group; every group's result is this rank's row."""

    scatters = True

    def reduce_scatter_average(self, tensor: torch.Tensor, name: str) -> torch.futures.Future:
        """FSDP's dense reduce-scatter of the ``[P * c]`` ``tensor`` (``ReduceOp.AVG``, its op for float32 and
        bfloat16); returns a completed future whose value is ``[this rank's row of the average]``.

        Blocking: Gloo's reduce-scatter work has no future, and FSDP reads the output as soon as its
        ``ReduceScatter`` returns anyway."""
        out = torch.empty(tensor.numel() // self.world_size, dtype=tensor.dtype, device=tensor.device)
        # Held aliases: Gloo's thread must not be the last owner of a Python tensor at exit (gradcomp.inflight).
        received, sent = inflight.hold(out, tensor)
        _reduce_scatter_flat(received, sent, op=dist.ReduceOp.AVG, group=self._group)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result([out])
        return done


class GradcompReduceScatter(ReduceScatter):
    """FSDP's ``ReduceScatter`` for one FSDP module: hands the call to its :class:`FSDPCompressionState`."""

    def __init__(self, state: "FSDPCompressionState", module_name: str):
        self.state, self.module_name = state, module_name

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op,
                 async_op: bool = False):
        """Write this rank's row of the average of ``input_tensor`` (``[P * c]``) into ``output_tensor``
        (``[c]``); returns once it is written (FSDP reads the output right after the call)."""
        self.state.reduce_scatter(self.module_name, output_tensor, input_tensor, group, op)
        return None


class FSDPCompressionState:
    """The engine of an FSDP model and the layout of each FSDP module's reduce-scatter input.

    Holds the :class:`~gradcomp.engine.Engine` (settings, residuals in a
    :class:`~gradcomp.compact_residuals.CompactResiduals`, step, telemetry), the FSDP mesh, and per
    FSDP module the keys and numels of its pieces. It is a ``torch.distributed.checkpoint`` ``Stateful``:
    :meth:`state_dict` gives residuals as DTensor rows (each rank saves and loads its own).
    """

    def __init__(self, engine: Engine, mesh, layouts: Dict[str, Tuple[Tuple[str, ...], Tuple[int, ...]]]):
        self.engine, self.mesh = engine, mesh
        #: FSDP module name -> (piece keys, their numels), row by row: the engine's group of that module.
        self.layouts = layouts
        #: What the one-call recipe chose (:class:`gradcomp.recipe.Plan`), or ``None``.
        self.recipe = None
        self._step_token: Optional[object] = None

    # -- one FSDP module's reduce-scatter ----------------------------------------------------
    def reduce_scatter(self, module_name: str, output: torch.Tensor, input_tensor: torch.Tensor, group, op) -> None:
        """The engine's step for one module: ``output`` (``[c]``) receives this rank's row of the average of
        ``input_tensor`` (``[P * c]``, FSDP's scratch: its own row is overwritten). Raises what the engine
        raises (a :class:`~gradcomp.validation.PayloadError` on every rank alike), writing nothing."""
        transport = self.engine.transport
        factor = _sum_factor(op, transport.world_size)
        if group.size() != transport.world_size or group.rank() != transport.rank:
            raise RuntimeError(f"gradcomp: FSDP reduce-scatters module {module_name!r} over a group of "
                               f"{group.size()} ranks, gradcomp was registered over {transport.world_size}")
        keys, numels = self.layouts[module_name]
        if input_tensor.numel() != sum(numels):
            raise RuntimeError(f"gradcomp: FSDP's reduce-scatter input of module {module_name!r} has "
                               f"{input_tensor.numel()} elements, its parameters {sum(numels)}; register() sets "
                               "set_reduce_scatter_unused_params(True): was it switched off?")
        token = self._begin_step()
        try:
            handle = self.engine.start(input_tensor, keys, numels, module_name)
            shard = self.engine.finish(handle, _collective_result(handle.work, module_name))
        except BaseException:
            self._end_step(token)  # autograd drops its final callbacks when a hook raises
            raise
        output.copy_(shard if factor == 1 else shard * factor)

    def _begin_step(self) -> object:
        """Open the step at the first reduce-scatter of a backward; it closes after FSDP's last one
        (an autograd final callback queued now runs after FSDP's own, which reduce-scatters the root)."""
        if self._step_token is None:
            token = self._step_token = object()
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_step(token))
        return self._step_token

    def _end_step(self, token: object) -> None:
        if self._step_token is token:
            self._step_token = None
            self.engine.end_step()

    # -- the engine's view -------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.engine.step

    def stats(self) -> dict:
        """See :meth:`gradcomp.telemetry.Telemetry.stats` (groups are FSDP module names)."""
        return self.engine.stats()

    def residual_bytes(self) -> int:
        """Bytes this rank keeps in residuals between steps (see :mod:`gradcomp.compact_residuals`)."""
        return self.engine.residual_memory.nbytes()

    def residual_numels(self) -> Dict[str, int]:
        """Every piece key that keeps a residual, with its numel (the checkpoint's residual entries)."""
        memory = self.engine.residual_memory
        return {key: numel for keys, numels in self.layouts.values() for key, numel in zip(keys, numels)
                if memory.keeps(numel)}

    # -- checkpoints: torch.distributed.checkpoint's Stateful ----------------------------------
    def state_dict(self) -> dict:
        """This rank's state for ``torch.distributed.checkpoint``: the engine's format
        (:func:`gradcomp.checkpoint.state_dict`) with the per-rank parts as DTensor rows on the FSDP mesh
        (every residual that can be kept, zero where none is held; the telemetry totals) and no ``"rank"``
        (each rank's row is its own). ``dcp.save({"gradcomp": state, ...})`` writes it, ``dcp.load``
        restores it (same world size)."""
        return dcp_state_dict(self.engine.state_dict(), self.residual_numels(), self.mesh,
                              self.engine.residual_memory.storage)

    def load_state_dict(self, state_dict: dict, unknown_residuals: str = "raise") -> None:
        """Restore :meth:`state_dict`'s output (after ``dcp.load``) or the engine's own per-rank format,
        transactionally (see :meth:`gradcomp.engine.Engine.load_state_dict`)."""
        saved = engine_state_dict(state_dict, self.engine.transport.rank)
        self.engine.load_state_dict(saved, self.residual_numels(), unknown_residuals)


def _sum_factor(op, world_size: int) -> int:
    """What the engine's average is multiplied by for FSDP's ``op``: 1 for ``AVG``; ``P`` for ``SUM`` (FSDP
    then divides by ``P`` itself: float16 reduction, ``set_force_sum_reduction_for_comms``)."""
    if op == dist.ReduceOp.AVG:
        return 1
    if op == dist.ReduceOp.SUM:
        return world_size
    raise ValueError(f"gradcomp averages gradients; FSDP asked for the reduce op {op!r} (a custom "
                     "set_gradient_divide_factor?): leave FSDP's default divide factor")


def _collective_result(work: torch.futures.Future, module_name: str) -> torch.Tensor:
    """The collective's output, or an error that says what failed and the likely cause."""
    try:
        return work.wait()[0]
    except Exception as error:
        raise RuntimeError(f"gradcomp: the reduce-scatter of FSDP module {module_name!r} failed: {error}. A peer "
                           "rank probably died or timed out; see the other ranks' logs. Residuals were left as "
                           "they were before this step.") from error


def _fsdp_modules(model: torch.nn.Module) -> List[Tuple[str, FSDPModule]]:
    """``(name, module)`` of every FSDP module of ``model`` that holds parameters (the root is ``"<root>"``)."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule) and any(g.fsdp_params for g in module._get_fsdp_state()._fsdp_param_groups):
            found.append((name or "<root>", module))
    return found


def _layouts(model, modules, world_size: int) -> Tuple[Dict[str, tuple], object]:
    """Per FSDP module, its reduce-scatter input's piece keys and numels (row by row); and the FSDP mesh.
    Refuses what gradcomp cannot reduce-scatter yet (HSDP, several meshes, a custom divide factor)."""
    names = {id(p): name for name, p in model.named_parameters()}
    layouts, meshes = {}, set()
    for module_name, module in modules:
        (group,) = module._get_fsdp_state()._fsdp_param_groups  # FSDP refuses a custom comm for several
        if group.gradient_divide_factor is not None:
            raise ValueError(f"FSDP module {module_name!r} has a custom gradient divide factor; gradcomp averages "
                             "gradients: leave set_gradient_divide_factor unset")
        mesh = group.mesh_info.mesh
        if mesh.ndim != 1:
            raise ValueError(f"FSDP module {module_name!r} is sharded on a {mesh.ndim}-D mesh (HSDP); gradcomp "
                             "reduce-scatters over a 1-D FSDP mesh only")
        meshes.add(mesh)
        pieces = [(names[id(p.sharded_param)], p.padded_sharded_param_size.numel()) for p in group.fsdp_params
                  if p.sharded_param.requires_grad]
        keys = tuple(piece_key(name, row, world_size) for row in range(world_size) for name, _ in pieces)
        layouts[module_name] = (keys, tuple(numel for _ in range(world_size) for _, numel in pieces))
    if len(meshes) != 1:
        raise ValueError(f"the model's FSDP modules use {len(meshes)} meshes; gradcomp needs one")
    return layouts, meshes.pop()


def _share_min_numel(layouts, world_size: int, share: float) -> int:
    """The ``min_numel`` under which parameters keep no residual so that those that do (the largest, by
    their pieces) hold at least ``share`` of the elements."""
    pieces = sorted({key.rsplit("[", 1)[0]: numel for keys, numels in layouts.values()
                     for key, numel in zip(keys, numels)}.values(), reverse=True)
    wanted, covered = share * sum(pieces), 0
    for numel in pieces:
        covered += numel
        if covered >= wanted:
            return numel * world_size
    return 0


def _refuse_unsharded_stage(compressor, model, kwargs: dict) -> None:
    """Raise before anything is registered if the recipe would give this optimizer a stage (a dry run of
    the recipe: no hook, no notice): the stages read every parameter's whole average and optimizer state."""
    if kwargs.get("total_steps") is None or kwargs.get("optimizer") is None:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a dry run: the real registration warns about what applies to it
        probe = prepare(compressor, model.named_parameters(), stage_hook=False, announce=False, **kwargs)
    if probe.recipe is None or probe.recipe.transform is None:
        return
    name = type(kwargs["optimizer"]).__name__
    raise ValueError(
        f"gradcomp: the recipe's optimizer stage for {name} ({probe.recipe.optimizer_stage}) cannot run under "
        "FSDP yet: it reads each parameter's whole average and optimizer state, and FSDP keeps one shard of them "
        f"on each rank. Under FSDP: pass total_steps= and scheduler= without optimizer= (the recipe's dense start "
        f"and ramp, with plain error feedback into your {name}), or use SGD (with momentum: no stage is needed), "
        "or train with DDP and gradcomp.register for the stage.")


@speaks_to_caller
def register(model: torch.nn.Module, compressor, *, optimizer=None, total_steps: Optional[int] = None,
             scheduler=None, min_compression: Optional[float] = None, residual_dtype: torch.dtype = torch.float32,
             residual_share: float = 1.0, **engine_kwargs) -> FSDPCompressionState:
    """Compress the reduce-scatters of the FSDP model ``model`` (the root ``fully_shard`` module) with
    ``compressor``; returns the state.

    The one-call recipe's arguments (``optimizer=``, ``total_steps=``, ``scheduler=``,
    ``min_compression=``) and ``compressor`` (or its spec) are :func:`gradcomp.setup.prepare`'s, as for
    DDP; an optimizer whose recipe has a stage (Adam, AdamW) is refused, with what to do. Residuals
    (one unsharded gradient per rank, see :mod:`gradcomp.compact_residuals`):

    * ``residual_dtype``: ``torch.float32`` (default) or ``torch.bfloat16`` (half the bytes; each
      committed residual rounded);
    * ``residual_share``: keep residuals only for the largest parameters that hold this share of the
      elements (``1.0``: all); the others travel dense inside the payload.

    ``engine_kwargs`` go to :class:`~gradcomp.engine.Engine` (``min_numel``, ``backend``, ``granularity``,
    ``error_feedback``, ``schedule``, ``warmup_steps``, ``grad_scaler``); ``policy`` and ``exchange`` are
    not offered under FSDP. Every FSDP module then reduce-scatters every parameter that requires a gradient
    (``set_reduce_scatter_unused_params(True)``, zeros for one that received none), so its layout is fixed.
    """
    if not isinstance(model, FSDPModule):
        raise TypeError(f"register() needs the root module that fully_shard wrapped, got {type(model).__name__}; "
                        "for DDP use gradcomp.register")
    for refused in ("policy", "exchange"):
        if engine_kwargs.get(refused) is not None:
            raise ValueError(f"{refused}= is not offered under FSDP: gradcomp reduce-scatters every module by its "
                             "compressed all-to-all")
    if not 0.0 < residual_share <= 1.0:
        raise ValueError(f"residual_share must be in (0, 1], got {residual_share!r}")
    modules = _fsdp_modules(model)
    if not modules:
        raise ValueError("the FSDP model holds no parameters to reduce-scatter")
    group = modules[0][1]._get_fsdp_state()._fsdp_param_groups[0]
    world_size = group.mesh_info.mesh.size()
    layouts, mesh = _layouts(model, modules, world_size)
    min_numel = engine_kwargs.pop("min_numel", DEFAULT_MIN_NUMEL)
    if residual_share < 1.0:
        min_numel = max(min_numel, _share_min_numel(layouts, world_size, residual_share))
    kwargs = dict(optimizer=optimizer, total_steps=total_steps, scheduler=scheduler, min_compression=min_compression,
                  min_numel=min_numel, sharded=True, **engine_kwargs)
    _refuse_unsharded_stage(compressor, model, kwargs)
    transport = FSDPTransport(mesh.get_group())
    setup = prepare(compressor, model.named_parameters(), announce=transport.rank == 0, **kwargs)
    engine = Engine(setup.compressor, transport, exchange=CompressedReduceScatter.name, **setup.settings)
    engine.agreement_steps = (0,)  # FSDP's layouts never change (no bucket rebuild): one check at the first step
    kept_from = dense_below(engine.min_numel, world_size) if engine.granularity == "parameter" else 0
    engine.residual_memory = CompactResiduals(residual_dtype, kept_from)
    state = FSDPCompressionState(engine, mesh, layouts)
    state.recipe = setup.recipe
    for name, module in modules:
        module.set_reduce_scatter_unused_params(True, recurse=False)
        module.set_custom_reduce_scatter(GradcompReduceScatter(state, name))
    logger.info("gradcomp: reduce-scattering %d FSDP modules over %d ranks with %r", len(modules), world_size,
                engine.compressor)
    return state
