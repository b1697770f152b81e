"""The direct allgather's works are posted off the caller's thread, receives before sends (gradcomp.hooks.direct).

In one process: ``torch.distributed``'s ``irecv`` and ``isend`` are replaced by recorders, so these check where
and in which order :func:`gradcomp.hooks.direct.gather` starts its works, not Gloo (``test_ddp.py`` gathers over
real Gloo ranks, two groups in flight and a peer that leaves).
"""
import threading

import pytest
import torch

from gradcomp.hooks import direct


class Work:
    """A finished point-to-point work that records its ``wait``."""

    def __init__(self, log, kind, peer):
        self.log, self.kind, self.peer = log, kind, peer

    def wait(self):
        self.log.append(("wait", self.kind, self.peer, threading.current_thread()))


@pytest.fixture
def posted(monkeypatch):
    """What the recorders saw: ``(op, kind, peer, thread)``; a received slot is filled with its sender's rank."""
    log = []

    def irecv(tensor, group=None, group_src=None, tag=0):
        assert tag == direct.tag_of("7")
        tensor.fill_(group_src)
        log.append(("post", "recv", group_src, threading.current_thread()))
        return Work(log, "recv", group_src)

    def isend(tensor, group=None, group_dst=None, tag=0):
        log.append(("post", "send", group_dst, threading.current_thread()))
        return Work(log, "send", group_dst)

    monkeypatch.setattr(direct.dist, "irecv", irecv)
    monkeypatch.setattr(direct.dist, "isend", isend)
    return log


def test_gather_returns_before_posting_and_posts_every_receive_before_any_send_on_another_thread(posted):
    buffer = torch.full((4,), 9, dtype=torch.uint8)
    future = direct.gather(buffer, None, 1, 3, "7")
    gathered = future.wait()[0]
    assert gathered.tolist() == [0] * 4 + [9] * 4 + [2] * 4  # rank order, the caller's own bytes in its slot
    posts = [(kind, peer) for op, kind, peer, _ in posted if op == "post"]
    assert posts == [("recv", 2), ("recv", 0), ("send", 2), ("send", 0)]
    assert [(kind, peer) for op, kind, peer, _ in posted if op == "wait"] == posts  # waited in the order started
    caller = threading.current_thread()
    assert all(thread is not caller for *_, thread in posted)  # the caller never holds a Gloo pair's lock


def test_calls_are_posted_in_the_order_they_were_made(posted):
    first = direct.gather(torch.zeros(2, dtype=torch.uint8), None, 0, 2, "7")
    second = direct.gather(torch.ones(3, dtype=torch.uint8), None, 0, 2, "7")
    assert second.wait()[0].tolist() == [1, 1, 1, 1, 1, 1] and first.wait()[0].tolist() == [0, 0, 1, 1]
    assert [kind for op, kind, _, _ in posted if op == "post"] == ["recv", "send", "recv", "send"]


def test_a_failure_while_posting_fails_the_future_after_the_works_already_started(posted, monkeypatch):
    def isend(tensor, group=None, group_dst=None, tag=0):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(direct.dist, "isend", isend)
    future = direct.gather(torch.zeros(2, dtype=torch.uint8), None, 0, 2, "7")
    with pytest.raises(RuntimeError, match="closed by peer"):
        future.wait()
    assert [(op, kind) for op, kind, _, _ in posted] == [("post", "recv"), ("wait", "recv")]
