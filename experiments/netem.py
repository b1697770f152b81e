"""Link emulation: run commands inside a private network namespace whose loopback is
rate-limited with ``tc ... tbf``, so local ranks talk over a link of a chosen speed.

How (as root)::

    ip netns add gcnetem-<pid>-<random>
    ip netns exec NAME ip link set lo mtu 1500 up
    ip netns exec NAME tc qdisc add dev lo root tbf rate 1gbit burst 125000 limit 16mb
    ip netns exec NAME env GLOO_SOCKET_IFNAME=lo MASTER_ADDR=127.0.0.1 <command>
    ip netns del NAME                       # always, in a finally

The namespace has only its own loopback, so no traffic can leave the machine. Gloo needs
``GLOO_SOCKET_IFNAME=lo`` there (it otherwise resolves the hostname to an interface the
namespace lacks, and hangs).

What the emulated link is. All ranks share one loopback, so the ``tbf`` rate is the
*aggregate* rate of all traffic between ranks, in both directions together: with 2
ranks each sending at once, each gets about half. It is a shared medium of the given
rate, which is harsher than two full-duplex NICs of that rate. The token bucket holds 1 ms of
the rate's bytes (at least 4 KB) and the queue before it is deep, so that a message takes its
time at the rate whether the link was idle before or not, and no packet is dropped; a sender's
queued bytes and offload packets are kept to a few ms of the rate (:mod:`experiments.netem_tbf`);
the loopback carries Ethernet's MTU so that such a bucket passes its packets.

Full duplex (``mode="duplex"``, ``--link-mode duplex``): one namespace per rank, each with one
interface ``gc0`` at ``10.213.0.<rank+1>/24`` whose veth peer sits on a bridge in a hub
namespace; ``tbf`` shapes the egress of both ends, so each direction of each rank's link has
the full rate, like a switched full-duplex NIC. All links are created inside the namespaces
(``ip -n``), none in the host's. A launcher runs on the host; rank ``r`` runs in its namespace
via :meth:`Link.rank_command` or calls :func:`join_rank_namespace` first thing
(``$GRADCOMP_NETNS_RANKS`` names the namespaces; ``GLOO_SOCKET_IFNAME=gc0``, ``MASTER_ADDR`` rank 0's).
Namespaces are deleted on leaving the ``with``, on SIGTERM (raised as ``SystemExit`` inside the
``with``) and at interpreter exit; ``--clean`` removes those of dead processes.

Without root, or when ``ip netns`` fails, :func:`link` falls back to the unshaped host
loopback, prints a loud warning, and marks the result (``link="unshaped"``,
``link_fallback=True``). Every subprocess here has a timeout.

Example::

    with link("1gbit") as shaped:
        launch.run_bounded(shaped.command([sys.executable, "-m", "experiments.train"]), env=shaped.env(), timeout=600)

    python -m experiments.netem --rate 1gbit --check            # measure the shaped rate
    python -m experiments.netem --rate 100mbit -- python -m experiments.train ...
    python -m experiments.netem --clean                         # remove stale namespaces

The command line is :func:`experiments.netem_probe.main`, beside the probes that ``--check`` runs.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from experiments.netem_tbf import MTU, UNSHAPED, default_queued, limit_queued, parse_rate, shape_device
from experiments.netem_tbf import run as _run

PREFIX = "gcnetem"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+(-(hub|r\d+))?$")
LINK_MODES = ("shared", "duplex")
#: The private range of the duplex topology; it exists only inside the namespaces made here.
DUPLEX_SUBNET = "10.213.0"
DUPLEX_IFNAME = "gc0"
CLONE_NEWNET = 0x40000000


@dataclass
class Link:
    """Where a command runs: a shaped namespace, or the unshaped host loopback.

    ``label`` is ``"unshaped"`` whenever no shaping is in effect, including a fallback;
    ``requested`` is the rate that was asked for; ``fallback_reason`` says why shaping
    could not be done (``None`` when it was done or not asked for).
    """

    label: str
    requested: Optional[str] = None
    namespace: Optional[str] = None
    fallback_reason: Optional[str] = None
    extra_env: Dict[str, str] = field(default_factory=dict)
    #: ``"shared"`` (one shaped loopback for all ranks) or ``"duplex"`` (a namespace per rank).
    mode: str = "shared"
    #: Duplex: rank ``r``'s namespace, whose interface :data:`DUPLEX_IFNAME` has :meth:`address` ``(r)``.
    rank_namespaces: Tuple[str, ...] = ()
    #: Duplex: the namespace holding the bridge that joins the ranks.
    hub: Optional[str] = None

    @property
    def shaped(self) -> bool:
        return self.namespace is not None or bool(self.rank_namespaces)

    @staticmethod
    def address(rank: int) -> str:
        """Rank ``rank``'s address on the duplex link (private, inside its namespace only)."""
        return f"{DUPLEX_SUBNET}.{rank + 1}"

    def rank_command(self, rank: int, argv: Sequence[str]) -> List[str]:
        """``argv`` prefixed to run as rank ``rank`` (duplex: in its own namespace; shared: :meth:`command`)."""
        if not self.rank_namespaces:
            return self.command(argv)
        return ["ip", "netns", "exec", self.rank_namespaces[rank], *argv]

    @property
    def fallback(self) -> bool:
        return self.fallback_reason is not None

    def command(self, argv: Sequence[str]) -> List[str]:
        """``argv`` prefixed to run inside the namespace (unchanged when unshaped, and in duplex
        mode, where a launcher runs on the host and each rank joins its namespace: :meth:`rank_command`
        or :func:`join_rank_namespace`)."""
        if self.namespace is None:
            return list(argv)
        return ["ip", "netns", "exec", self.namespace, *argv]

    def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """``base`` (default ``os.environ``) plus what ranks need to talk over the loopback."""
        env = dict(os.environ if base is None else base)
        env.update({"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "GRADCOMP_LINK": self.label})
        env.pop("GRADCOMP_NETNS_RANKS", None)
        if self.rank_namespaces:
            env.update({"GLOO_SOCKET_IFNAME": DUPLEX_IFNAME, "MASTER_ADDR": self.address(0),
                        "GRADCOMP_NETNS_RANKS": ",".join(self.rank_namespaces)})
        if self.namespace is not None:
            env["GRADCOMP_NETNS"] = self.namespace
        else:
            env.pop("GRADCOMP_NETNS", None)
        env.update(self.extra_env)
        return env

    def record(self) -> dict:
        """Fields for a results record."""
        return {
            "link": self.label,
            "link_requested": self.requested or UNSHAPED,
            "link_mode": self.mode,
            "shaped": self.shaped,
            "link_fallback": self.fallback,
            "link_fallback_reason": self.fallback_reason,
        }


def shaping_unavailable_reason() -> Optional[str]:
    """Why shaping cannot be attempted here (``None``: it can be)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not running as root (network namespaces and tc need root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the '{tool}' command (iproute2) is not installed"
    return None


def list_namespaces() -> List[str]:
    """Names of this machine's network namespaces (empty if ``ip`` cannot tell)."""
    try:
        listing = _run(["ip", "netns", "list"], check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.split()[0] for line in listing.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale() -> List[str]:
    """Delete namespaces of ours (``gcnetem-<pid>-...``) whose creating process is gone;
    those of live processes (a concurrent run) are left alone. Returns the deleted names."""
    removed = []
    for name in list_namespaces():
        match = _NAME.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _delete(name)
            removed.append(name)
    return removed


def _namespace_pids(name: str) -> List[int]:
    try:
        listing = _run(["ip", "netns", "pids", name], check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(word) for word in listing.stdout.split() if word.isdigit()]


def _delete(name: str) -> None:
    # Processes left in the namespace (ours: only we run commands there) would keep it
    # alive after `ip netns del`; stop them by pid first.
    for pid in _namespace_pids(name):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        _run(["ip", "netns", "del", name], check=False)


def warn_unshaped(requested: str, reason: str) -> None:
    """The loud warning printed when shaping was asked for and is not in effect."""
    bar = "!" * 78
    message = textwrap.fill(
        f"netem: could not shape the link to {requested}: {reason}. Running on the UNSHAPED "
        "host loopback instead; step times will NOT reflect that link, and results are "
        "labelled link=unshaped, link_fallback=true.",
        width=76,
    )
    print(f"\n{bar}\n{message}\n{bar}\n", file=sys.stderr, flush=True)


def _create(name: str, rate: str) -> None:
    _run(["ip", "netns", "add", name])
    _run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "mtu", str(MTU), "up"])
    shape_device(name, "lo", rate)
    limit_queued(name, rate, default_queued(name))


def _create_duplex(hub: str, ranks: Sequence[str], rate: str) -> None:
    """A star of full-duplex links: rank ``r``'s namespace has interface :data:`DUPLEX_IFNAME`
    at ``10.213.0.<r+1>/24``, the other end of its veth pair sits on a bridge in ``hub``.
    Both ends' egress is shaped at ``rate`` (:mod:`experiments.netem_tbf`), so each direction of
    each rank's link has the full rate (rank -> hub on the rank's end, hub -> rank on the hub's end). Every link is
    created inside the namespaces (``ip -n``), never in the host's."""
    _run(["ip", "netns", "add", hub])
    _run(["ip", "-n", hub, "link", "add", "br0", "type", "bridge"])
    _run(["ip", "-n", hub, "link", "set", "br0", "up"])
    for rank, name in enumerate(ranks):
        _run(["ip", "netns", "add", name])
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        _run(["ip", "-n", hub, "link", "add", f"h{rank}", "type", "veth", "peer", "name", DUPLEX_IFNAME,
              "netns", name])  # fmt: skip
        _run(["ip", "-n", hub, "link", "set", f"h{rank}", "mtu", str(MTU), "master", "br0", "up"])
        _run(["ip", "-n", name, "addr", "add", f"{Link.address(rank)}/24", "dev", DUPLEX_IFNAME])
        _run(["ip", "-n", name, "link", "set", DUPLEX_IFNAME, "mtu", str(MTU), "up"])
        shape_device(name, DUPLEX_IFNAME, rate)
        shape_device(hub, f"h{rank}", rate)
        limit_queued(name, rate, default_queued(hub))


# Namespaces this process created and has not deleted yet: removed at exit even when a
# ``with link(...)`` is never closed (a SIGTERM, an exception in a generator left open).
_LIVE: List[str] = []


def _delete_all(names: Sequence[str]) -> None:
    present = set(list_namespaces())
    for name in names:
        if name in present:
            _delete(name)
        with contextlib.suppress(ValueError):
            _LIVE.remove(name)


@atexit.register
def _delete_live() -> None:
    _delete_all(list(_LIVE))


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While inside, SIGTERM raises SystemExit (so ``finally`` blocks delete the namespaces)
    where it would otherwise kill the process outright; only in the main thread, and only
    when no handler of the program's own is installed."""
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def unwind(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def link(rate: Optional[str], mode: str = "shared", ranks: int = 2) -> Iterator[Link]:
    """A :class:`Link` at ``rate`` (``None``/``"unshaped"``: the host loopback) for the
    duration of the ``with``; its namespaces are always deleted afterwards (also on an
    exception, SIGTERM, or at interpreter exit).

    ``mode="shared"``: one namespace whose loopback is shaped; all ranks share the rate.
    ``mode="duplex"``: one namespace per rank (``ranks`` of them) joined through a bridge by
    veth pairs, each direction shaped at ``rate`` (:func:`_create_duplex`); run rank ``r`` with
    :meth:`Link.rank_command` or have it call :func:`join_rank_namespace`.

    Falls back to the unshaped loopback, with :func:`warn_unshaped`, when not root or
    when creating the namespaces fails.
    """
    if mode not in LINK_MODES:
        raise ValueError(f"link mode must be one of {LINK_MODES}, got {mode!r}")
    if mode == "duplex" and not 1 <= ranks <= 250:
        raise ValueError(f"a duplex link joins 1..250 ranks, got {ranks}")
    rate = parse_rate(rate)
    if rate is None:
        yield Link(label=UNSHAPED, mode=mode)
        return
    reason = shaping_unavailable_reason()
    if reason is not None:
        warn_unshaped(rate, reason)
        yield Link(label=UNSHAPED, requested=rate, fallback_reason=reason, mode=mode)
        return
    clean_stale()
    name = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
    names = [name] if mode == "shared" else [f"{name}-hub"] + [f"{name}-r{r}" for r in range(ranks)]
    _LIVE.extend(names)
    with _sigterm_unwinds():
        try:
            try:
                if mode == "shared":
                    _create(name, rate)
                else:
                    _create_duplex(names[0], names[1:], rate)
            except (OSError, subprocess.SubprocessError) as error:
                detail = getattr(error, "stderr", None) or str(error)
                reason = f"creating the namespace failed ({detail.strip()})"
                warn_unshaped(rate, reason)
                _delete_all(names)
                yield Link(label=UNSHAPED, requested=rate, fallback_reason=reason, mode=mode)
                return
            if mode == "shared":
                yield Link(label=rate, requested=rate, namespace=name)
            else:
                yield Link(label=rate, requested=rate, mode=mode, hub=names[0], rank_namespaces=tuple(names[1:]))
        finally:
            _delete_all(names)


def join_rank_namespace(rank: int, env: Optional[Dict[str, str]] = None) -> Optional[str]:
    """Move the calling thread (call it first thing in a rank process, before any thread or
    socket is made) into rank ``rank``'s namespace of a duplex link named by
    ``$GRADCOMP_NETNS_RANKS``; returns the namespace, ``None`` when there is none to join."""
    import ctypes

    names = (env if env is not None else os.environ).get("GRADCOMP_NETNS_RANKS", "")
    if not names:
        return None
    names = names.split(",")
    if not 0 <= rank < len(names) or not _NAME.match(names[rank]):
        raise ValueError(f"rank {rank} has no namespace in GRADCOMP_NETNS_RANKS={','.join(names)!r}")
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{names[rank]}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {names[rank]} failed: {os.strerror(errno)}")
    finally:
        os.close(fd)
    return names[rank]


if __name__ == "__main__":
    # The command line is experiments.netem_probe's (it prints the probes' rates for --check).
    from experiments.netem_probe import main

    sys.exit(main())
