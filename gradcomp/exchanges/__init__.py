"""Exchanges: how a group's gradient travels between the ranks, one object behind one interface.

:class:`~gradcomp.exchanges.base.Exchange` is the interface (``applies``, ``compress``,
``start``, ``finish``, ``commit``, ``cost``, ``settings``, ``state_dict``, ``prepare_load``) and
:class:`~gradcomp.exchanges.base.ExchangeContext` the narrow view of the engine an exchange gets;
:mod:`~gradcomp.exchanges.registry` holds them by name. The engine asks its chain of exchanges
(:func:`registry.chain`) for the one that applies to each group; the cost model
(:mod:`gradcomp.costmodel`), the settings check between ranks (:mod:`gradcomp.agreement`), the
checkpoints (:mod:`gradcomp.checkpoint`) and the telemetry read the registry. Which names
``Engine(exchange=...)`` accepts: ``names(selectable=True)``; the default: :data:`DEFAULT`.

Every module of this package is imported here, so a new exchange is one new file in it,
decorated with ``@exchange_name("...")``.
"""
import importlib
import pkgutil

from gradcomp.exchanges.base import Exchange, ExchangeContext, Handle, average_gathered, compress_group
from gradcomp.exchanges.registry import DEFAULT, chain, check_selectable, exchange_name, get, names

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["Exchange", "ExchangeContext", "Handle", "average_gathered", "compress_group", "DEFAULT", "chain",
           "check_selectable", "exchange_name", "get", "names"]
