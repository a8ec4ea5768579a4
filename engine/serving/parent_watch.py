"""A server that dcpctl started stops itself once the process that started it is gone.

`PlanServer` names itself to the servers it starts (SUPERVISOR_ENV: its pid): `dcpctl run` supervising a P/D
deployment, an eval or a bench. A parent killed outright (SIGKILL, the OOM killer) runs no clean-up; its servers
notice within a second and stop cleanly (SIGTERM to themselves). Standard library only: the vLLM shim, which runs in
vLLM's venv without dcpctl's packages, loads this file by its path.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

SUPERVISOR_ENV = "DCPCTL_SUPERVISOR_PID"  # set for the servers a process starts: its pid


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def stop_without_supervisor() -> None:
    """In a server whose starter SUPERVISOR_ENV names: SIGTERM to itself, a clean stop, once that starter is gone,
    also when it was gone before this ran. Its parent as a rule (then a reused pid cannot fool the watch); a starter
    with a process between (a wrapper) is watched by its pid. Does nothing in a process started otherwise."""
    parent = os.environ.pop(SUPERVISOR_ENV, "")
    if not parent.isdigit():
        return
    starter = int(parent)
    direct = os.getppid() == starter

    def watch() -> None:
        while os.getppid() == starter if direct else _exists(starter):
            time.sleep(1.0)
        print(
            f"error: the dcpctl process {parent} that started this server is gone; stopping",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="dcpctl-supervisor-watch", daemon=True).start()
