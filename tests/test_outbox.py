"""Sends off the compute thread (crucible.worker.outbox): FIFO, the compute
thread does not wait for a send, flush waits for all of them, a failed send
is raised on the compute thread, and `off` (the CPU default) runs inline.
On a GPU the same object also waits for the compute stream and sends on a
side stream (tests/test_gpu.py runs pipelines with it, on the GPU and here)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from crucible.worker.outbox import Outbox, SendFailed, overlapping

CPU = torch.device("cpu")


def test_overlap_is_on_where_the_setting_says():
    assert overlapping("auto", torch.device("cuda", 0)) and not overlapping("auto", CPU)
    assert overlapping("on", CPU) and not overlapping("off", torch.device("cuda", 0))


def test_sends_leave_in_order_and_the_compute_thread_does_not_wait_for_them():
    box = Outbox(CPU, overlap=True)
    try:
        gate, out = threading.Event(), []
        box.submit(lambda: (gate.wait(10), out.append(0)))
        for i in range(1, 50):
            box.submit(lambda i=i: out.append(i))
        assert out == []                               # submit returned before the blocked send ran
        assert box.flush(timeout=0.2) is False         # ... and flush waits for it
        gate.set()
        assert box.flush(timeout=10) is True
        assert out == list(range(50))
    finally:
        box.close()


def test_a_failed_send_is_raised_on_the_compute_thread_once():
    box = Outbox(CPU, overlap=True)
    try:
        out = []
        box.submit(lambda: 1 / 0)
        box.submit(lambda: out.append("after"))        # the outbox goes on with later sends
        with pytest.raises(SendFailed, match="ZeroDivisionError"):
            box.flush(timeout=10)
        assert out == ["after"]
        box.submit(lambda: out.append("again"))
        assert box.flush(timeout=10) and out == ["after", "again"]
    finally:
        box.close()


def test_a_send_raised_before_the_next_submit():
    box = Outbox(CPU, overlap=True)
    try:
        box.submit(lambda: 1 / 0)
        deadline = time.monotonic() + 10
        while box.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(SendFailed):
            box.submit(lambda: None)
    finally:
        box.close()


def test_off_runs_each_send_inline():
    box = Outbox(CPU, overlap=False)
    me, ran_on = threading.get_ident(), []
    box.submit(lambda: ran_on.append(threading.get_ident()))
    assert ran_on == [me] and box.thread is None
    with pytest.raises(ZeroDivisionError):
        box.submit(lambda: 1 / 0)
    assert box.flush(timeout=0) is True


class Boom(BaseException):
    """Not an Exception: what a bare `except Exception` would let through."""


def test_the_thread_survives_whatever_a_send_raises():
    box = Outbox(CPU, overlap=True)
    try:
        out = []

        def boom():
            raise Boom("not an Exception")

        box.submit(boom)
        box.submit(lambda: out.append("after"))
        with pytest.raises(SendFailed, match="Boom"):
            box.flush(timeout=10)
        assert box.thread.is_alive() and out == ["after"]
    finally:
        box.close()


def test_close_drops_queued_sends_and_ends_the_thread_once_the_running_one_returns():
    box = Outbox(CPU, overlap=True)
    started, stream_closed, out = threading.Event(), threading.Event(), []
    box.submit(lambda: (started.set(), stream_closed.wait(10), out.append("running")))   # as on a full stream
    for i in range(5):
        box.submit(lambda i=i: out.append(i))
    assert started.wait(10)
    box.stop()
    assert box.join(0.2) is False                     # the running send has not returned yet
    stream_closed.set()                               # ... until its stream closes
    t0 = time.monotonic()
    assert box.join(5) is True and time.monotonic() - t0 < 2
    assert out == ["running"] and box.pending == 0    # the queued ones were dropped, not sent late
    box.submit(lambda: out.append("late"))            # a send after close is dropped too
    assert box.flush(timeout=1) is True and out == ["running"]
    inline = Outbox(CPU, overlap=False)
    inline.close()
    inline.submit(lambda: out.append("late inline"))  # ... with overlap off as well
    assert out == ["running"]


def test_a_send_blocked_on_a_full_stream_returns_when_the_successor_is_killed(tmp_path):
    """A successor that stops reading, then dies (SIGKILL): the stream's reader
    marks it broken, so a send waiting on its full queue gives up at once
    instead of waiting for the compute thread (the one flush holds) to notice
    (before, flush waited for ever)."""
    from crucible._pb import crucible_pb2 as pb
    from crucible.wire import outgoing
    from crucible.worker.dataplane import Downstream
    from conftest import ROOT, child_env

    server = ("import sys, threading\n"
              "from crucible import rpc\n"
              "from crucible._pb import crucible_pb2 as pb\n"
              "def pipe(frames, ctx):\n"
              "    next(frames)\n"
              "    threading.Event().wait()\n"
              "    yield pb.Frame()\n"
              "srv, port = rpc.make_server('crucible.v1.Stage', {'Pipe': rpc.stream_stream('Pipe', pb.Frame, pb.Frame,"
              " pipe)}, 't', '127.0.0.1:0', max_workers=2)\n"
              "print(port, flush=True)\n"
              "threading.Event().wait()\n")
    proc = subprocess.Popen([sys.executable, "-c", server], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    down, box = None, Outbox(CPU, overlap=True)
    try:
        port = int(proc.stdout.readline())
        events = []
        # 0.001 Mbit/s: the first frame holds the stream for 30 s, so the queue fills and stays full
        down = Downstream(f"127.0.0.1:{port}", pb.Frame(kind=pb.Frame.HELLO, epoch=1), "t", 64, 0.001,
                          lambda ev, *_: events.append(ev), lambda f: f)
        frame = pb.Frame(kind=pb.Frame.FORWARD, epoch=1, tensor=pb.Tensor(data=b"x" * 4096))
        queued = outgoing(frame)                   # what ``send`` queues (an Outgoing, the stream's form)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:         # fill until it stays full (the stream takes one frame
            while not down.q.full():               # into its 30 s wait; only this thread puts)
                down.q.put_nowait(queued)
            time.sleep(0.5)
            if down.q.full():
                break
        assert down.q.full() and not events
        box.submit(lambda: down.send(frame))       # a send the compute thread handed off ...
        assert box.flush(timeout=1.0) is False     # ... waits on the full queue
        os.killpg(proc.pid, signal.SIGKILL)
        assert box.flush(timeout=15) is True, "the send still waits on a stream whose successor is dead"
        assert down.broken and not down.failed     # failed stays the compute thread's (it reports the suspect)
        assert [ev.note for ev in events] == ["down_error"]
    finally:
        if down is not None:
            down.close(wait=0.0)
        box.close()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def test_links_flush_ends_on_a_stop_request_without_raising():
    """A stop while the step's sends are still out: flush returns (the caller
    finishes the step's bookkeeping; its next check_stop exits) instead of
    raising in the middle of it."""
    from crucible.config import Config
    from crucible.worker.links import Links

    stop = threading.Event()

    def check_stop():
        raise AssertionError("flush must not raise on a stop")

    links = Links(0, 0, "t", Config.load(), None, None, suspect=lambda *a: None, on_epoch=lambda e: None,
                  check_stop=check_stop, idle=lambda: None, stopping=stop.is_set)
    links.outbox.close()
    links.outbox = Outbox(CPU, overlap=True)
    gate, done = threading.Event(), threading.Event()
    try:
        links.outbox.submit(lambda: gate.wait(30))   # a send that does not return
        flusher = threading.Thread(target=lambda: (links.flush(), done.set()), daemon=True)
        flusher.start()
        assert not done.wait(1.0)                    # flush waits for it ...
        stop.set()
        assert done.wait(5)                          # ... until the stop
    finally:
        gate.set()
        links.outbox.close()
