"""The one registry of exchanges by name, and the chain of exchanges an engine tries per group.

An exchange class names itself with a class decorator::

    @exchange_name("two_phase")
    class TwoPhase(Exchange): ...

The name is what ``Engine(exchange=...)`` accepts (for a class marked ``selectable``), what
``stats()`` reports as a group's ``"mode"``, what :func:`gradcomp.costmodel.predict` takes and
what the cross-rank settings check compares. Every module of :mod:`gradcomp.exchanges` is
imported when the package is, so a new exchange is one new file there (and its tests); an
exchange defined elsewhere (a test's) registers when its module is imported.
"""
from __future__ import annotations

import re
from typing import Callable, Dict, Optional, Tuple, Type, TypeVar

from gradcomp.exchanges.base import Exchange

__all__ = ["DEFAULT", "exchange_name", "get", "names", "check_selectable", "chain", "by_state_key", "state_keys"]

#: The exchange of payloads that cannot be summed when none is named; every other selectable
#: exchange falls back to it for the groups it does not apply to, so it applies to every group.
DEFAULT = "allgather"

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
#: name -> class, in registration order.
_BY_NAME: Dict[str, Type[Exchange]] = {}

E = TypeVar("E", bound=Type[Exchange])


def exchange_name(name: str) -> Callable[[E], E]:
    """Class decorator: register an :class:`~gradcomp.exchanges.base.Exchange` subclass as ``name``.

    Registering the same class again is a no-op; a name taken by another class, or a class
    already registered under another name, raises ``ValueError``.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"exchange names are lower-case identifiers such as 'allgather', got {name!r}")

    def decorator(cls: E) -> E:
        if not (isinstance(cls, type) and issubclass(cls, Exchange)):
            raise TypeError(f"exchange_name({name!r}) decorates Exchange subclasses, got {cls!r}")
        taken = _BY_NAME.get(name)
        if taken is not None and taken is not cls:
            raise ValueError(f"exchange name {name!r} is already registered to {taken.__qualname__}")
        if vars(cls).get("name", name) != name:
            raise ValueError(f"{cls.__qualname__} is already registered as {cls.name!r}")
        cls.name = name
        _BY_NAME[name] = cls
        return cls

    return decorator


def get(name: str) -> type:
    """The exchange class registered as ``name``; ``ValueError`` listing the known names otherwise."""
    cls = _BY_NAME.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown exchange {name!r}; choose one of {names()}")
    return cls


def names(**attributes) -> Tuple[str, ...]:
    """The registered names, in registration order, of the classes whose class attributes equal
    ``attributes`` (``names(selectable=True)``: what ``Engine(exchange=...)`` accepts)."""
    return tuple(name for name, cls in _BY_NAME.items()
                 if all(getattr(cls, key) == value for key, value in attributes.items()))


def check_selectable(name, scatters: bool = False) -> str:
    """``name`` if ``Engine(exchange=name)`` may use it, else a ``ValueError`` that lists those that may.
    With ``scatters`` (the engine's transport is FSDP's reduce-scatter) the choice is among the
    scattering exchanges that compress (``Exchange.scatters``), and only among them."""
    allowed = names(scatters=True, sends_gradient=False) if scatters else names(selectable=True)
    if name not in allowed:
        under = " under a transport that scatters (FSDP's reduce-scatter)" if scatters else ""
        raise ValueError(f"exchange must be one of {allowed}{under}, got {name!r}")
    return name


def chain(name: str, scatters: bool = False, **settings) -> tuple:
    """The exchanges an engine configured with ``exchange=name`` tries for each group, in order:
    the automatic ones (mutually exclusive: a dense step, a summable payload), then ``name``, then
    :data:`DEFAULT` for the groups ``name`` does not apply to. With ``scatters``: the scattering
    exchanges that send the gradient itself (dense steps), then ``name``. ``settings`` (the engine's
    ``granularity`` and ``min_numel``) go to every constructor."""
    chosen = get(check_selectable(name, scatters))
    if scatters:
        classes = [cls for cls in _BY_NAME.values() if cls.scatters and cls.sends_gradient] + [chosen]
    else:
        classes = [cls for cls in _BY_NAME.values() if cls.automatic] + [chosen]
        if name != DEFAULT:
            classes.append(get(DEFAULT))
    return tuple(cls(**settings) for cls in classes)


def by_state_key(key: str) -> Optional[type]:
    """The exchange class whose checkpoint state is saved under ``key`` (``None``: no such class)."""
    return next((cls for cls in _BY_NAME.values() if cls.state_key == key), None)


def state_keys() -> Tuple[str, ...]:
    """The checkpoint keys under which exchanges save state (see :mod:`gradcomp.checkpoint`)."""
    return tuple(cls.state_key for cls in _BY_NAME.values() if cls.state_key is not None)


def _forget(name: str) -> Optional[Type]:
    """Remove ``name`` from the registry (tests register exchanges of their own); returns its class."""
    return _BY_NAME.pop(name, None)
