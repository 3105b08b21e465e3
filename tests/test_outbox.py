"""Sends off the compute thread (crucible.worker.outbox): FIFO, the compute
thread does not wait for a send, flush waits for all of them, a failed send
is raised on the compute thread, and `off` (the CPU default) runs inline.
On a GPU the same object also waits for the compute stream and sends on a
side stream (tests/test_gpu.py runs pipelines with it, on the GPU and here)."""

from __future__ import annotations

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
