"""The server's guard (vllm_patch/launch/guard.py) with real processes: a
supervisor that ends while its server runs takes the server's whole group
with it, even when the server itself was SIGKILLed first (what Ray does to a
dying worker's direct children), and a guard whose group ended on its own
leaves without signalling anything. No Ray, no vLLM: the launch tier's
test_a_node_lost_with_survivors_keeps_serving_and_rejoins covers the guard
under a real Ray node loss."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from vllm_patch.launch import guard
from vllm_patch.launch.supervisor import GUARD

pytestmark = [pytest.mark.unit, pytest.mark.patched_only]

# A server stand-in: its own session, one child in its group (the engine
# core) that it does NOT stop when it is killed.
SERVER = ("import subprocess, sys, time; "
          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
          "print('up', flush=True); time.sleep(600)")
# A supervisor stand-in: starts the server and its guard as the real one
# does (InstanceSupervisor._start_guard's command), prints the server's pid.
SUPERVISOR = """
import os, subprocess, sys
server = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True,
                          stdout=subprocess.PIPE, text=True)
assert server.stdout.readline().strip() == "up"
subprocess.run([sys.executable, "-I", "-S", sys.argv[2], str(os.getpid()),
                str(server.pid), sys.argv[3], sys.argv[4]], start_new_session=True,
               check=True, timeout=30)
print(server.pid, flush=True)
server.wait()  # reaped, as the supervisor's thread does
import time; time.sleep(600)
"""


def _group(pgid: int) -> list[int]:
    out = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (OSError, psutil.Error):
            continue
    return out


def _wait_empty(pgid: int, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while _group(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _group(pgid)


def _start(tmp_path: Path, grace_s: float = 2.0):
    log = tmp_path / "server.log"
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR, SERVER, GUARD, str(grace_s),
                            str(log)], stdout=subprocess.PIPE, text=True)
    pgid = int(sup.stdout.readline())
    deadline = time.monotonic() + 30
    while len(_group(pgid)) < 2:  # the server and its child
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return sup, pgid, log


def test_the_group_goes_when_the_supervisor_dies_and_the_server_was_killed(tmp_path):
    sup, pgid, log = _start(tmp_path)
    try:
        members = _group(pgid)
        os.kill(pgid, signal.SIGKILL)  # the server, as Ray kills direct children
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait(10)
        t0 = time.monotonic()
        assert _wait_empty(pgid, 10) == [], "the engine core stand-in was left"
        assert time.monotonic() - t0 < 5
        assert set(members) >= {pgid}
        deadline = time.monotonic() + 5  # the guard notes it once the group is gone
        while not (log.exists() and "the supervisor (pid" in log.read_text()):
            assert time.monotonic() < deadline, "no note in the server's log"
            time.sleep(0.1)
    finally:
        for p in _group(pgid):
            os.kill(p, signal.SIGKILL)


def test_stop_group_kills_what_ignores_sigterm():
    p = subprocess.Popen([sys.executable, "-c",
                          "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "print('up', flush=True); time.sleep(600)"],
                         start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    t0 = time.monotonic()
    assert guard.stop_group(p.pid, 1.0) is True  # SIGKILL was needed
    assert p.wait(10) == -signal.SIGKILL
    assert 1.0 <= time.monotonic() - t0 < 5


def test_a_guard_whose_group_ended_leaves_quietly(tmp_path):
    sup, pgid, log = _start(tmp_path)
    try:
        guards = [p for p in psutil.process_iter(["cmdline"])
                  if GUARD in (p.info["cmdline"] or []) and str(pgid) in p.info["cmdline"]]
        assert len(guards) == 1
        os.killpg(pgid, signal.SIGKILL)  # the group ends while the supervisor lives
        assert _wait_empty(pgid, 10) == []
        deadline = time.monotonic() + 10
        while guards[0].is_running() and guards[0].status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the guard did not leave"
            time.sleep(0.1)
        assert sup.poll() is None
        assert not log.exists() or "the supervisor" not in log.read_text()
    finally:
        sup.kill()
        sup.wait(10)
