"""DGC momentum correction: the compression state owns SGD's momentum (Lin et al., ICLR 2018).

Error feedback into an optimizer that applies momentum *after* the exchange amplifies EF's
bursts: an entry held back for many steps is released at once and then carried by the
momentum for ~1/(1-m) more steps. Measured on charlm-small (2 ranks, 200 steps, SGD momentum
0.9, lr 0.1): library EF into SGD-momentum 3.280 held-out loss against dense 2.686; DGC's
momentum correction with factor masking and the sparsity ramp, 2.460; at 2000 steps DGC with
the ramp ended within 0.5% of dense (1.654 vs 1.646).

The algorithm, per parameter, on every rank (``g``: the local gradient; ``u``: the local
velocity, owned here; ``v``: the accumulated velocity, which is the engine's error-feedback
residual)::

    u = m * u + g                     # before_compress: momentum correction, local
    acc = v + u;  send C(acc);  v = acc - D(C(acc))   # the engine's compensate/compress
    u[sent] = 0                       # after_compress: momentum factor masking (sparsifiers)

and the optimizer applies the *average of the sent velocities* with plain SGD (no momentum):
``p -= lr * mean_r D(C(acc_r))``. On a dense step ``u`` is sent whole and not masked, which is
exactly SGD with momentum (the average of the local velocities is the global velocity).

Masking zeroes the velocity where the whole accumulated value was sent. A 2-bit code sends only
``+-t`` of it, so with quantizers masking is off by default (``masking=None`` decides by the
compressor: on for compressors whose payload has ``indices``, i.e. sparsifiers).

Use::

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0)   # momentum moves here:
    dgc = DGC(model.named_parameters(), momentum=0.9, optimizer=optimizer)
    gradcomp.hooks.ddp.register(ddp_model, TopK(0.01), schedule=SparsityRamp(), transform=dgc)
"""
from __future__ import annotations

import math
from typing import Dict, Hashable, Iterable, Optional, Sequence, Tuple, Union

import torch

from gradcomp.error_feedback import ErrorFeedback
from gradcomp.optim.names import unwrapped

__all__ = ["DGC", "optimizer_settings"]


def _check_momentum_free(optimizer) -> None:
    """Raise if ``optimizer`` applies momentum of its own: momentum would then be applied twice."""
    for index, group in enumerate(getattr(optimizer, "param_groups", ())):
        if "betas" in group:
            raise ValueError(
                f"gradcomp.optim.DGC is momentum correction for SGD; the optimizer {type(optimizer).__name__} "
                "keeps Adam moments of its own. Use gradcomp.optim.CompressedAdamW for Adam/AdamW"
            )
        if group.get("momentum") not in (0, 0.0, None):
            raise ValueError(
                f"gradcomp.optim.DGC owns the momentum, but the optimizer's param group {index} has "
                f"momentum={group['momentum']}; create it with momentum=0 (e.g. torch.optim.SGD(params, "
                "lr=..., momentum=0.0)) and give the momentum to DGC(momentum=...)"
            )


def _plain(value):
    """``value`` as plain, repr-stable Python (tensors become numbers or tuples)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else tuple(value.reshape(-1).tolist())
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    return value


def optimizer_settings(optimizer) -> Optional[Tuple[Tuple[Tuple[str, object], ...], ...]]:
    """Each param group's hyperparameters (all but ``params``), sorted, as plain values; ``None``
    without an optimizer. Ranks whose optimizers differ would move their replicas apart."""
    if optimizer is None:
        return None
    return tuple(tuple(sorted((k, _plain(v)) for k, v in group.items() if k not in ("params", "step")))
                 for group in optimizer.param_groups)


class DGC:
    """The ``transform`` of the engine that implements DGC's momentum correction.

    Args:
        named_parameters: ``model.named_parameters()`` of the wrapped module (the keys the
            engine uses); used to find each parameter's learning rate.
        momentum: the momentum factor ``m`` in ``[0, 1)`` (what the optimizer had before).
        optimizer: the user's optimizer. Checked to hold no momentum (a clear error if it does),
            and read for the learning rate of each parameter (for ``rescale_on_lr_change``).
        masking: momentum factor masking at sent coordinates: ``True``, ``False`` or ``None``
            (default: on for sparsifying compressors, off for quantizers; see the module docstring).
        rescale_on_lr_change: when a parameter's learning rate changes from ``lr_prev`` to
            ``lr_now``, multiply its velocity by ``lr_prev / lr_now`` so that what it still
            carries moves the weights as far as it would have (BytePS does this for residuals;
            the engine's residuals are rescaled through ``residual_memory`` when given).
            Default ``False``: torch's SGD keeps its velocity in gradient units across
            learning-rate changes, and so does this, matching dense SGD-momentum exactly.
        residual_memory: the engine's :class:`~gradcomp.ErrorFeedback` (``state.residual_memory``)
            to rescale with the velocity; optional.
        weight_decay: SGD's L2 term, moved here with the momentum: ``u = m * u + g + wd * p``
            (the optimizer then runs with ``weight_decay=0``), which is torch's SGD exactly.

    State: one float32 velocity per parameter name, transactional like the residuals (written
    to a spare buffer, committed only when the step's average is finite on every rank).
    """

    def __init__(
        self,
        named_parameters: Iterable[Tuple[str, torch.nn.Parameter]],
        momentum: float = 0.9,
        optimizer=None,
        masking: Optional[bool] = None,
        rescale_on_lr_change: bool = False,
        residual_memory: Optional[ErrorFeedback] = None,
        weight_decay: float = 0.0,
    ):
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
        if masking not in (True, False, None):
            raise ValueError(f"masking must be True, False or None (by compressor), got {masking!r}")
        if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or not weight_decay >= 0:
            raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.masking = masking
        self.rescale_on_lr_change = bool(rescale_on_lr_change)
        self.residual_memory = residual_memory
        self.optimizer = optimizer
        self._params: Dict[str, torch.nn.Parameter] = dict(unwrapped(named_parameters))
        if not self._params:
            raise ValueError("DGC needs the model's named_parameters() (got none)")
        if optimizer is not None:
            _check_momentum_free(optimizer)
        self.velocity = ErrorFeedback()  # keyed, flat per group, transactional float32 storage
        self._pending: Dict[Tuple[Hashable, ...], torch.Tensor] = {}
        self._lr: Dict[Hashable, float] = {}

    # -- the engine's transform protocol -------------------------------------------------
    def before_compress(self, keys: Sequence[Hashable], numels: Sequence[int], grad: torch.Tensor) -> torch.Tensor:
        """``u' = m * u + g`` for the group; returns ``u'`` (float32 ``[n]``, a spare buffer that
        :meth:`commit` makes current). ``grad`` is not mutated."""
        return self._velocity_step(keys, numels, grad)

    def dense(self, keys: Sequence[Hashable], numels: Sequence[int], grad: torch.Tensor) -> torch.Tensor:
        """The same on a dense step; nothing is masked (all of ``u'`` is sent)."""
        return self._velocity_step(keys, numels, grad)

    def after_compress(self, keys: Sequence[Hashable], payload, compressor, numel: int) -> None:
        """Momentum factor masking: zero ``u'`` where ``payload`` sends the entry."""
        keys = tuple(keys)
        velocity = self._pending.get(keys)
        if velocity is None:
            raise RuntimeError(f"after_compress for {keys[:3]}... without before_compress")
        sparsifier = compressor.sparsifies
        if not (self.masking if self.masking is not None else sparsifier):
            return
        if sparsifier:
            velocity.index_fill_(0, compressor.sent_indices(payload).to(torch.int64), 0.0)
        else:
            decoded = torch.zeros(numel, dtype=torch.float32, device=velocity.device)
            compressor.decompress_add(payload, decoded)
            velocity.masked_fill_(decoded != 0, 0.0)

    def commit(self, keys: Sequence[Hashable], accept: Union[bool, torch.Tensor] = True) -> None:
        """Make ``u'`` the velocity of ``keys`` if ``accept`` (may be a 0-d device tensor)."""
        keys = tuple(keys)
        if self._pending.pop(keys, None) is not None:
            self.velocity.commit(keys, accept)

    # -- internals -------------------------------------------------------------------------
    def _velocity_step(self, keys, numels, grad: torch.Tensor) -> torch.Tensor:
        keys = tuple(keys)
        if self.optimizer is not None:
            _check_momentum_free(self.optimizer)  # cheap; catches momentum set after construction
            if self.rescale_on_lr_change:
                self._rescale(keys, numels, grad.device)
        current, spare = self.velocity.buffers(keys, numels, grad.device)
        grad = grad.float()
        if self.weight_decay:
            grad = grad + self.weight_decay * torch.cat([self._param(key).detach().reshape(-1).float()
                                                         for key in keys])
        torch.add(grad, current, alpha=self.momentum, out=spare)
        self._pending[keys] = spare
        return spare

    def _param(self, key) -> torch.nn.Parameter:
        try:
            return self._params[key]
        except KeyError:
            raise KeyError(f"DGC has no parameter named {key!r}; build it from the named_parameters() of the module "
                           "that DDP wraps") from None

    def parameter_names(self):
        """The names this stage knows (the engine's keys)."""
        return set(self._params)

    def _lr_of(self) -> Dict[int, float]:
        return {id(p): float(group["lr"]) for group in self.optimizer.param_groups for p in group["params"]}

    def _rescale(self, keys, numels, device) -> None:
        """Multiply velocity (and residuals, if given) by ``lr_prev / lr_now`` per parameter."""
        lrs = self._lr_of()
        current, _ = self.velocity.buffers(keys, numels, device)
        offset = 0
        for key, n in zip(keys, numels):
            param = self._params.get(key)
            lr_now = lrs.get(id(param)) if param is not None else None
            lr_prev = self._lr.get(key)
            if lr_now is not None:
                # From or to a learning rate of 0 there is no ratio to keep: a factor of 0 would
                # erase the velocity, an infinite one blow it up.
                if lr_prev is not None and lr_now > 0 and lr_prev > 0 and lr_prev != lr_now:
                    factor = lr_prev / lr_now
                    if math.isfinite(factor):
                        current[offset: offset + n].mul_(factor)
                        residual = self.residual_memory.residual(key) if self.residual_memory is not None else None
                        if residual is not None:
                            residual.mul_(factor)
                self._lr[key] = lr_now
            offset += n

    # -- checkpoints ---------------------------------------------------------------------------
    def _recipe(self) -> dict:
        """The settings a checkpoint must have been saved with (the learning rate may change)."""
        return {"momentum": self.momentum, "masking": self.masking, "rescale_on_lr_change": self.rescale_on_lr_change,
                "weight_decay": self.weight_decay}

    def settings(self) -> dict:
        """Every setting that changes how a replica moves, as plain values, one entry per argument of
        ``__init__`` (the cross-rank check hashes them): the recipe, the parameters' names and sizes,
        whether residuals are rescaled with the velocity, and the optimizer's param-group
        hyperparameters (a different learning rate makes replicas diverge)."""
        return {**self._recipe(), "optimizer": optimizer_settings(self.optimizer),
                "residual_memory": self.residual_memory is not None,
                "named_parameters": tuple((name, p.numel()) for name, p in self._params.items())}

    def state_dict(self) -> dict:
        """``{"settings": {...}, "velocity": {name: float32 tensor}, "lr": {name: float}}``, on CPU."""
        return {
            "settings": self._recipe(),
            "velocity": self.velocity.state_dict()["residuals"],
            "lr": dict(self._lr),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`; raises ``ValueError`` (changing nothing) if it does not fit."""
        self.prepare_load(state_dict)()

    def prepare_load(self, state_dict: dict):
        """Validate :meth:`state_dict`'s output and return the function that assigns it (which does
        not fail): the settings, a velocity for parameters of this model only, each of its
        parameter's size and finite in float32, the learning rates finite numbers. Raises
        ``ValueError``; changes nothing."""
        from gradcomp.checkpoint import check_float_vector

        if not isinstance(state_dict, dict) or not {"settings", "velocity"} <= set(state_dict):
            raise ValueError("expected the dict from DGC.state_dict() (with 'settings' and 'velocity')")
        unknown = sorted(set(state_dict) - {"settings", "velocity", "lr"})
        if unknown:
            raise ValueError(f"the DGC state has keys {unknown} that DGC.state_dict() does not write")
        if state_dict["settings"] != self._recipe():
            raise ValueError(f"the checkpoint's DGC settings {state_dict['settings']} differ from this run's "
                             f"{self._recipe()}")
        velocity = state_dict["velocity"]
        if not isinstance(velocity, dict):
            raise ValueError(f"the DGC 'velocity' must be a dict of name -> tensor, got {type(velocity).__name__}")
        for name, value in velocity.items():
            if name not in self._params:
                raise ValueError(f"the checkpoint has a velocity for {name!r}, which is no parameter of this model")
            check_float_vector(value, f"the velocity of {name!r}")
            if value.numel() != self._params[name].numel():
                raise ValueError(f"the velocity of {name!r} does not match its parameter's size")
        saved_lr = state_dict.get("lr", {})
        if not isinstance(saved_lr, dict):
            raise ValueError(f"the DGC 'lr' must be a dict of name -> float, got {type(saved_lr).__name__}")
        lr = {}
        for name, value in saved_lr.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"the learning rate of {name!r} in the DGC state must be a finite number >= 0, "
                                 f"got {value!r}")
            lr[name] = float(value)

        def assign() -> None:
            self.velocity.load_state_dict({"residuals": dict(velocity)})
            self._pending.clear()
            self._lr = lr

        return assign

    def __repr__(self) -> str:
        return f"DGC(momentum={self.momentum}, masking={self.masking})"
