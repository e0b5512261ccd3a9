"""Stops a vLLM server's whole process group when its supervisor dies.

The supervisor (a Ray actor) starts each vLLM server in a session of its
own, so a stop reaches vLLM's engine core and workers too (they stay in the
server's process group). When the supervisor's process dies without calling
stop(), nobody signals that group: Ray kills a dying worker's direct
children with SIGKILL (`RAY_kill_child_processes_on_worker_exit`, on by
default), so the API server dies at once and cannot stop its engine core,
which is left running on the node with its memory (seen when Ray declared a
node dead after a network partition and its raylet exited).

This guard is started by the supervisor next to each server, detached (a
second fork, in a session of its own) so that Ray's clean-up of the
supervisor's children does not take it too. It waits for the supervisor's
process to end (a pidfd: no confusion with a reused pid) or for the group to
be empty; in the first case it sends the group SIGTERM, then SIGKILL after
the grace period, and notes it in the server's log. Standard library only:
it runs with `python -I -S`.

    python -I -S guard.py SUPERVISOR_PID PGID GRACE_S LOG_PATH
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

POLL_S = 0.5


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user took the group id
        return False


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def _watcher(pid: int):
    """A function that waits up to POLL_S and says whether `pid` has ended."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd: compare its start time
        born = _start_time(pid)

        def ended() -> bool:
            time.sleep(POLL_S)
            return _start_time(pid) != born
        return ended
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    return lambda: bool(poll.poll(POLL_S * 1000))


def _note(log_path: str, text: str) -> None:
    try:
        with open(log_path, "a") as f:
            f.write(f"\n===== {time.strftime('%H:%M:%S')} {text}\n")
    except OSError:
        pass


def stop_group(pgid: int, grace_s: float) -> bool:
    """SIGTERM, then SIGKILL after `grace_s`; True when SIGKILL was needed."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return False
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def watch(supervisor_pid: int, pgid: int, grace_s: float, log_path: str) -> str:
    """Until the group is empty ("done") or the supervisor has ended (then
    the group is stopped: "stopped")."""
    ended = _watcher(supervisor_pid)
    while group_alive(pgid):
        if ended():
            killed = stop_group(pgid, grace_s)
            _note(log_path, f"the supervisor (pid {supervisor_pid}) is gone: the "
                            f"server's processes (group {pgid}) were stopped"
                            + (" (SIGKILL after the grace period)" if killed else ""))
            return "stopped"
    return "done"


def main(argv: list[str]) -> int:
    supervisor_pid, pgid, grace_s, log_path = int(argv[0]), int(argv[1]), float(argv[2]), argv[3]
    # Detach: the supervisor reaps the first child at once; the second is no
    # child of the supervisor, so Ray's clean-up of its children spares it.
    if os.fork() > 0:
        os._exit(0)
    watch(supervisor_pid, pgid, grace_s, log_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
