"""The full-duplex link emulation (``experiments.netem``, ``mode="duplex"``), built for real:
namespaces per rank, veth pairs on a bridge, tbf on each end, a real 2-rank Gloo job across it,
and every namespace gone afterwards (normal exit, exception, SIGTERM). Needs root and iproute2."""
import os
import signal
import subprocess
import sys
import time

import pytest

from experiments import netem, netem_probe, netem_tbf

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(netem.shaping_unavailable_reason() is not None,
                                 reason=f"duplex emulation needs {netem.shaping_unavailable_reason()}")]


def ours(prefix):
    return [name for name in netem.list_namespaces() if name.startswith(prefix)]


def qdisc(namespace, device):
    return subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "show", "dev", device],
                          capture_output=True, text=True, timeout=20, check=True).stdout


def stack(namespace, device):
    """``(gso_max_segs of device, tcp_limit_output_bytes)`` in ``namespace``."""
    shown = subprocess.run(["ip", "-d", "-n", namespace, "link", "show", device], capture_output=True, text=True,
                           timeout=20, check=True).stdout
    return int(shown.split("gso_max_segs ")[1].split()[0]), netem_tbf.default_queued(namespace)


def run_ranks(commands, env):
    """Start both ranks' ``commands``; wait for them (killing any still running after 120 s); assert both
    exited with 0; return their outputs (stdout and stderr)."""
    ranks = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for command in commands]
    try:
        outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait(10)
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    return outputs


def test_a_link_changes_rate_on_every_end_and_back():
    # The step-time benchmark changes a duplex link's rate between rounds: every end's bucket, offload packets
    # and the senders' queued bytes follow, and unshaped restores the kernel's defaults.
    with netem.link("100mbit", mode="duplex", ranks=2) as link:
        default = netem_tbf.default_queued(link.hub)
        ends = [(name, netem.DUPLEX_IFNAME) for name in link.rank_namespaces] + [(link.hub, "h0"), (link.hub, "h1")]
        for rate, shown, segments, queued in [("100mbit", "100Mbit", 34, 50_000), (None, None, 65535, default),
                                              ("10mbit", "10Mbit", 4, netem_tbf.MIN_QUEUED)]:
            if rate != "100mbit":
                netem_tbf.set_rate(link.rank_namespaces, link.hub, netem.DUPLEX_IFNAME, rate)
            for namespace, device in ends:
                assert (shown is None) == ("tbf" not in qdisc(namespace, device)), (rate, namespace, device)
                assert shown is None or shown in qdisc(namespace, device)
                assert stack(namespace, device)[0] == segments, (rate, namespace, device)
            assert [stack(n, netem.DUPLEX_IFNAME)[1] for n in link.rank_namespaces] == [queued, queued], rate


@pytest.mark.slow  # a 2-rank Gloo job across the shaped link; the namespace tests below stay quick
def test_duplex_link_shapes_each_direction_and_carries_a_gloo_job():
    with netem.link("100mbit", mode="duplex", ranks=2) as link:
        prefix = link.hub[: -len("-hub")]
        assert link.shaped and link.mode == "duplex" and len(link.rank_namespaces) == 2
        assert sorted(ours(prefix)) == sorted([link.hub, *link.rank_namespaces])
        # tbf on both ends of each rank's veth: rank -> bridge on the rank's end, bridge -> rank on the hub's.
        for rank, namespace in enumerate(link.rank_namespaces):
            for shown in (qdisc(namespace, netem.DUPLEX_IFNAME), qdisc(link.hub, f"h{rank}")):
                assert "tbf" in shown and "100Mbit" in shown and "burst 12500b" in shown, shown

        # Each direction has the full rate: both at once take about as long as one alone (a shared
        # medium would halve each, their sum staying at the rate). Generous bounds: the machine may be loaded.
        nbytes = 6 << 20
        alone = netem_probe.measure_duplex_gbit_s(link, nbytes, both=False)[0]
        both = netem_probe.measure_duplex_gbit_s(link, nbytes, both=True)
        assert 0.04 < alone < 0.12, alone
        assert sum(both) > 1.4 * alone and min(both) > 0.5 * alone, (alone, both)

        # A real 2-rank Gloo job across the link: rank 0 started in its namespace, rank 1 joins its own.
        env = dict(link.env(), PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        assert env["GLOO_SOCKET_IFNAME"] == netem.DUPLEX_IFNAME and env["MASTER_ADDR"] == netem.Link.address(0)
        worker = os.path.join(HERE, "netem_workers.py")
        outputs = run_ranks([link.rank_command(0, [sys.executable, worker, "0", "2", "29517"]),
                             [sys.executable, worker, "1", "2", "29517", "join"]], env)
        assert f"ok 0 {netem.DUPLEX_IFNAME}" in outputs[0] and f"ok 1 {netem.DUPLEX_IFNAME}" in outputs[1], outputs
    assert ours(prefix) == []


@pytest.mark.slow  # two 2-rank Gloo jobs across a 10 Mbit/s link
def test_a_late_rank_receives_its_peers_payload_at_the_rate():
    # Gloo announces a receive on the stream that carries the payloads, and its allgather sends first: a rank
    # 30 ms late wrote its own 121 KB ahead of its announcement, and its peer's payload waited behind them (148 ms
    # against 101 at the rate in every repeat). gradcomp's transport posts the receives first.
    late = {}
    with netem.link("10mbit", mode="duplex", ranks=2) as link:
        env = dict(link.env(), PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        worker = os.path.join(HERE, "netem_late_worker.py")
        for port, kind in ((29518, "gloo"), (29519, "gradcomp")):
            outputs = run_ranks([link.rank_command(r, [sys.executable, worker, str(r), str(port), kind])
                                 for r in range(2)], env)
            late[kind] = float(outputs[1].split("late ")[1].split()[0]) / 1e3
    at_rate = 121_000 / 1.25e6 * 1514 / 1448  # TCP/IP's headers: 66 bytes of each 1,514 on the wire
    assert late["gradcomp"] < 1.12 * at_rate, (late, at_rate)
    assert late["gloo"] > 1.25 * at_rate, (late, at_rate)  # the control: the test sees the wait it guards


def test_a_message_after_a_pause_takes_its_time_at_the_rate():
    # A method that sends a few KB between the steps of others must not cross the link faster than the rate
    # allows: the bucket's tokens saved while idle cut at most its 4 KB (3.3 ms at 10 Mbit/s) from a message
    # (a 128 KB bucket sent 64 KB in 0.2 ms after 0.3 s idle), and the deep queue drops nothing (behind a
    # 100-ms queue a retransmission timeout made 200 KB take 335 ms).
    sizes = [16_000, 64_000, 200_000]
    with netem.link("10mbit", mode="duplex", ranks=2) as link:
        seconds = netem_probe.message_seconds(link, sizes, gap=0.3, repeats=3)
    at_rate = [n / 1.25e6 for n in sizes]
    for n, took, line in zip(sizes, seconds, at_rate):
        assert line - 0.004 < took < 1.4 * line + 0.01, (n, took, line)


def test_duplex_namespaces_are_removed_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with netem.link("1gbit", mode="duplex", ranks=3) as link:
            prefix = link.hub[: -len("-hub")]
            assert len(ours(prefix)) == 4
            raise RuntimeError("boom")
    assert ours(prefix) == []


def test_duplex_namespaces_are_removed_after_sigterm():
    script = ("import sys, time\nfrom experiments import netem\n"
              "with netem.link('1gbit', mode='duplex', ranks=2) as link:\n"
              "    print(link.hub, flush=True)\n    time.sleep(120)\n")
    process = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        hub = process.stdout.readline().strip()
        prefix = hub[: -len("-hub")]
        assert hub and len(ours(prefix)) == 3
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    deadline = time.monotonic() + 10
    while ours(prefix) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ours(prefix) == []


def test_shared_mode_is_kept_and_bad_modes_are_refused():
    with netem.link("1gbit") as link:
        assert link.mode == "shared" and link.namespace and not link.rank_namespaces
        assert "tbf" in qdisc(link.namespace, "lo")
    with pytest.raises(ValueError, match="link mode"):
        with netem.link("1gbit", mode="halfduplex"):
            pass
