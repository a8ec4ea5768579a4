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


def stop_without_supervisor() -> None:
    """In a server whose starter SUPERVISOR_ENV names (and is its parent): SIGTERM to itself, a clean stop, once
    that parent is gone. Does nothing in a process started otherwise."""
    parent = os.environ.pop(SUPERVISOR_ENV, "")
    if not parent.isdigit() or os.getppid() != int(parent):
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(1.0)
        print(
            f"error: the dcpctl process {parent} that started this server is gone; stopping",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="dcpctl-supervisor-watch", daemon=True).start()
