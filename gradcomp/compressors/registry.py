"""One registry of compressors by name, and the spec strings that name a configured compressor.

A *spec* is ``name`` or ``name:arguments``, the arguments separated by commas, each a value
(positional) or ``key=value``::

    from_spec("topk:0.01")              # TopK(density=0.01)
    from_spec("topk:density=0.01")      # the same
    from_spec("twobit:0.5"), from_spec("twobit:rms"), from_spec("fp16")

Values are parsed as ``true``/``false`` (bool), ``none`` (None), an integer, a float
(``0.01``, ``1e-3``), or else a bare word (``rms``). Names are case-insensitive.

Every registered compressor has a ``spec`` property, its canonical spec: the registered
name, the first declared setting as a value and the others as ``key=value`` (left out at their
constructor default, so a spec written before a setting existed names the same compressor), floats written
with ``repr`` (the shortest string that reads back as the same double). So
``from_spec(c.spec).spec == c.spec`` exactly, on every machine: checkpoints record
``spec`` and ranks compare it to agree on their settings.

A compressor class takes its name in the registry with a class decorator::

    @spec_name("topk", params=("density",))
    class TopK(Compressor): ...

``params`` are the constructor's keyword names whose values (read back as attributes of
the instance) make up the spec; a class with its own settings format may define ``spec``
itself instead.
"""
from __future__ import annotations

import inspect
import math
import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Type, TypeVar, Union

from gradcomp.compressors.base import Compressor

__all__ = ["spec_name", "from_spec", "spec_of", "registered"]

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
_INTEGER = re.compile(r"^[+-]?[0-9]+$")
_KEYWORD_VALUES = {"true": True, "false": False, "none": None}

#: name -> (class, params), in registration order.
_BY_NAME: Dict[str, Tuple[Type[Compressor], Tuple[str, ...]]] = {}
_NAME_OF: Dict[Type[Compressor], str] = {}

C = TypeVar("C", bound=Type[Compressor])


def spec_name(name: str, params: Sequence[str] = ()) -> Callable[[C], C]:
    """Class decorator: make ``cls`` constructible by :func:`from_spec` as ``name``.

    Args:
        name: lower-case identifier, unique in the registry (``"topk"``).
        params: constructor keywords that, read back from the instance as attributes,
            describe it completely; the first is written positionally in the spec.
    Registering the same class under the same name again is a no-op; a name already
    taken by another class, or a class already registered under another name, raises
    ``ValueError``.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"compressor names are lower-case identifiers such as 'topk', got {name!r}")
    params = tuple(params)
    for param in params:
        if not isinstance(param, str) or not param.isidentifier():
            raise ValueError(f"spec_name({name!r}): params must be keyword names, got {param!r}")

    def decorator(cls: C) -> C:
        if not (isinstance(cls, type) and issubclass(cls, Compressor)):
            raise TypeError(f"spec_name({name!r}) decorates Compressor subclasses, got {cls!r}")
        taken = _BY_NAME.get(name)
        if taken is not None and taken[0] is not cls:
            raise ValueError(f"compressor name {name!r} is already registered to {taken[0].__qualname__}")
        if _NAME_OF.get(cls, name) != name:
            raise ValueError(f"{cls.__qualname__} is already registered as {_NAME_OF[cls]!r}")
        _BY_NAME[name] = (cls, params)
        _NAME_OF[cls] = name
        if "spec" not in vars(cls):
            cls.spec = property(_canonical_spec,
                                doc="The canonical spec: ``from_spec(self.spec)`` rebuilds this compressor.")
        return cls

    return decorator


def registered() -> Dict[str, Type[Compressor]]:
    """The registered compressor classes by name, in registration order."""
    return {name: cls for name, (cls, _) in _BY_NAME.items()}


def _known() -> str:
    return ", ".join(sorted(_BY_NAME)) or "(none)"


def _format_value(owner: str, key: str, value) -> str:
    if value is None or isinstance(value, bool):
        return {None: "none", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{owner}.{key} = {value!r} has no spec: settings must be finite")
        return repr(value)
    if isinstance(value, str) and _WORD.match(value) and value.lower() not in _KEYWORD_VALUES:
        return value
    raise TypeError(f"{owner}.{key} = {value!r} cannot be written in a spec (numbers, booleans and bare words only)")


def spec_of(compressor: Optional[Compressor]) -> Optional[str]:
    """The string that names ``compressor`` in checkpoints and in the settings check between ranks:
    its ``spec`` (the canonical spec of a registered compressor, or a class's own), else its
    ``repr``; ``None`` for ``None`` (a dense step)."""
    if compressor is None:
        return None
    spec = getattr(compressor, "spec", None)
    return spec if isinstance(spec, str) else repr(compressor)


def _canonical_spec(compressor: Compressor) -> str:
    """The canonical spec of a registered compressor (see the module docstring), its ``spec`` property.

    Raises ``TypeError`` for a compressor whose exact class is not registered (a subclass
    of a registered class too: its spec would rebuild the parent, not it).
    """
    cls = type(compressor)
    name = _NAME_OF.get(cls)
    if name is None:
        raise TypeError(
            f"{cls.__qualname__} is not in the compressor registry (known: {_known()}); decorate it with "
            "@gradcomp.compressors.spec_name('name', params=(...)) so it can be named, checkpointed and "
            "compared across ranks"
        )
    parts = []
    defaults = _keyword_defaults(cls)
    for index, param in enumerate(_BY_NAME[name][1]):
        value = getattr(compressor, param)
        if index > 0 and param in defaults and value == defaults[param]:
            continue  # a setting at its default is left out: specs written before it existed still match
        value = _format_value(cls.__qualname__, param, value)
        parts.append(value if index == 0 else f"{param}={value}")
    return f"{name}:{','.join(parts)}" if parts else name


def _keyword_defaults(cls) -> Dict[str, object]:
    """The constructor's keyword defaults of ``cls`` (name -> value)."""
    return {name: parameter.default for name, parameter in inspect.signature(cls.__init__).parameters.items()
            if parameter.default is not inspect.Parameter.empty}


def _parse_value(text: str) -> Union[bool, None, int, float, str]:
    lowered = text.lower()
    if lowered in _KEYWORD_VALUES:
        return _KEYWORD_VALUES[lowered]
    if _INTEGER.match(text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        pass
    if _WORD.match(text):
        return text
    raise ValueError(f"cannot read {text!r} as a number, true/false/none or a bare word")


def _split(spec: str) -> Tuple[str, List, Dict[str, object]]:
    name, colon, arguments = spec.partition(":")
    name = name.strip().lower()
    positional: List = []
    keywords: Dict[str, object] = {}
    if not colon:
        return name, positional, keywords
    if not arguments.strip():
        raise ValueError("nothing after ':'")
    for item in arguments.split(","):
        key, equals, value = (part.strip() for part in item.partition("="))
        if not (value if equals else key):
            raise ValueError("an empty argument")
        if not equals:
            if keywords:
                raise ValueError(f"positional argument {key!r} after a keyword argument")
            positional.append(_parse_value(key))
            continue
        if not key.isidentifier():
            raise ValueError(f"{key!r} is not a keyword name")
        if key in keywords:
            raise ValueError(f"{key!r} given twice")
        keywords[key] = _parse_value(value)
    return name, positional, keywords


def from_spec(spec: Union[str, Compressor]) -> Compressor:
    """The compressor a spec names: ``"topk:0.01"``, ``"twobit:0.5"``, ``"fp16"``, ...

    A :class:`Compressor` is returned unchanged, so arguments may take either form.
    Raises ``ValueError`` for an unknown name (listing the known ones) or arguments the
    compressor rejects, ``TypeError`` for anything but a string or a compressor.
    """
    if isinstance(spec, Compressor):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a compressor spec is a string such as 'topk:0.01', got {type(spec).__name__}")
    try:
        name, positional, keywords = _split(spec)
    except ValueError as error:
        raise ValueError(
            f"malformed compressor spec {spec!r}: {error}; expected 'name' or 'name:value,key=value'"
        ) from None
    entry = _BY_NAME.get(name)
    if entry is None:
        raise ValueError(
            f"unknown compressor {name!r} in spec {spec!r}; known: {_known()} (e.g. 'topk:0.01', 'twobit:0.5', 'fp16')"
        )
    cls, params = entry
    if (positional or keywords) and not params:
        raise ValueError(f"compressor spec {spec!r}: {name} takes no arguments; write {name!r}")
    try:
        return cls(*positional, **keywords)
    except (TypeError, ValueError) as error:
        raise ValueError(f"compressor spec {spec!r}: {error}") from None
