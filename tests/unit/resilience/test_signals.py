"""The SIGTERM stall watch: a process that a SIGTERM finds blocked ends itself; one that makes progress goes on
to act on the signal. Each case is a fresh interpreter (the watch owns the process's wakeup fd and exits it)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO

SCRIPT = """
import signal, socket, sys, time
import lit_ddp.compat  # a fit has imported it (and Lightning) long before a SIGTERM: the exit costs no import
from lit_ddp.resilience import signals
signals.install(signal.SIGTERM)
signals.watch_for_stalls(0.5, describe=lambda: "rank 3")
print("ready", flush=True)
if sys.argv[1] == "blocked":  # stands for a collective whose peer is gone: never returns
    a, b = socket.socketpair()
    a.recv(1)
end = time.monotonic() + 2.0
while time.monotonic() < end:  # steps of 50 ms
    time.sleep(0.05)
    signals.beat()
print("requested", signals.requested(), flush=True)
"""


@pytest.mark.serial
@pytest.mark.parametrize("main_thread", ["blocked", "stepping"])
def test_sigterm_ends_a_blocked_process_and_not_a_stepping_one(main_thread: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, main_thread], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    if main_thread == "blocked":
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert 0.5 <= took < 5.0, took  # the watch's 0.5 s, then one write and os._exit: 10x margin
        [line] = err.splitlines()
        assert line.startswith("lit-ddp: error: rank 3: SIGTERM received and no step finished in 0.5 s"), line
    else:
        assert proc.returncode == 0, err
        assert out == f"requested {int(signal.SIGTERM)}\n" and err == ""
