"""NIXL with its UCX backend: the only module that imports `nixl_cu12`.

One agent per rank registers the rank's whole KV storage once. A decode rank READs from prefill ranks with
descriptor lists built from numpy arrays (never NIXL's pickled descriptor lists: those must not come off the
network). Agents run without NIXL's progress thread (it spins about half a core while idle); the target side
(prefill) is progressed by a thread that polls every few milliseconds instead, the initiator by its own polling.
A peer that dies raises from NIXL; one that hangs is never reported, so every wait has its own deadline.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np

PROGRESS_INTERVAL_S = 0.005  # the target side's polling: ~1.4 % of a core while idle, measured
INSTALL_HINT = "install it with `pip install nixl-cu12` (scripts/setup.sh does)"
HOLD_ENV = "DCPCTL_TEST_HOLD_READ"  # tests only: a folder where a READ in flight waits for a file `go` (faults)
HOLD_MAX_S = 30.0
_open_agents: weakref.WeakSet[Agent] = weakref.WeakSet()


class TransferError(Exception):
    """A READ failed or passed its deadline; the message says how."""


def _nixl() -> Any:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # its INFO lines go to stdout, which offline output owns
    from nixl_cu12 import _api

    return _api


def unavailable_reason() -> str | None:
    """Why NIXL cannot be used in this environment (None when it can)."""
    try:
        _nixl()
    except Exception as exc:  # an ImportError, or a shared library that fails to load
        return f"the NIXL transport cannot be imported ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    return None


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _hold_in_flight() -> None:
    """Tests only ($DCPCTL_TEST_HOLD_READ set): say that a READ is in flight and wait until the test says go (at
    most HOLD_MAX_S), so that a peer can be killed mid-transfer deterministically."""
    folder = Path(os.environ[HOLD_ENV])
    (folder / f"reading-{os.getpid()}").touch()
    deadline = time.monotonic() + HOLD_MAX_S
    while not (folder / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


class Agent:
    """A NIXL agent that has registered one memory region (a rank's KV storage)."""

    def __init__(self, name: str, base_addr: int, nbytes: int, device_id: int, on_gpu: bool):
        api = _nixl()
        self.name = name
        self.memory = "VRAM" if on_gpu else "DRAM"
        self.device_id = device_id
        self._agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._regions = [self._register(base_addr, nbytes)]
        self._remotes: dict[str, bytes] = {}  # remote agent name -> the metadata it was added with
        self._scratch: tuple[int, Any, Any] | None = None  # (bytes, tensor, registration) for raw READs
        self._progress: threading.Thread | None = None
        self._closed = threading.Event()
        _open_agents.add(self)

    def _register(self, base_addr: int, nbytes: int) -> Any:
        return self._agent.register_memory([(base_addr, nbytes, self.device_id, "")], self.memory)

    def metadata(self) -> bytes:
        """What a peer needs to reach this agent (opaque bytes, a few hundred)."""
        return self._agent.get_agent_metadata()

    def start_progress(self) -> None:
        """Progress this agent as a READ target from a daemon thread (prefill ranks)."""

        def poll() -> None:
            while not self._closed.wait(PROGRESS_INTERVAL_S):
                with contextlib.suppress(Exception):
                    self._agent.get_new_notifs()

        self._progress = threading.Thread(target=poll, name="dcpctl-nixl-progress", daemon=True)
        self._progress.start()

    def connect(self, name: str, metadata: bytes) -> None:
        """Add a remote agent (once per name and metadata); TransferError when it cannot be reached."""
        if self._remotes.get(name) == metadata:
            return
        try:
            added = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise TransferError(f"cannot connect to {name} ({_error_text(exc)})") from None
        added = added.decode() if isinstance(added, bytes) else added
        if added != name:
            self.disconnect(added)
            raise TransferError(f"the agent metadata names {added!r}, not {name!r}")
        self._remotes[name] = metadata

    def disconnect(self, name: str) -> None:
        """Forget a remote agent (after a failure; a later connect adds it again)."""
        self._remotes.pop(name, None)
        with contextlib.suppress(Exception):
            self._agent.remove_remote_agent(name)

    def _descs(self, addr: np.ndarray, length: np.ndarray, device_id: int, memory: str) -> Any:
        rows = np.empty((len(addr), 3), dtype=np.uint64)
        rows[:, 0], rows[:, 1], rows[:, 2] = addr, length, device_id
        return self._agent.get_xfer_descs(rows, memory)

    def read(
        self, reads: list[tuple[str, int, np.ndarray, np.ndarray, np.ndarray]], timeout_s: float, memory: str
    ) -> float:
        """READ every (remote name, remote device id, src addrs, dst addrs, lengths) at once; seconds taken.

        TransferError names the remote agent and how it failed: an error from NIXL or no completion in time.
        """
        handles: list[tuple[str, Any]] = []
        start = time.perf_counter()
        try:
            for name, device_id, src, dst, length in reads:
                if not len(length):
                    continue
                try:
                    local = self._descs(dst, length, self.device_id, self.memory)
                    remote = self._descs(src, length, device_id, memory)
                    handle = self._agent.initialize_xfer("READ", local, remote, name)
                    handles.append((name, handle))
                    state = self._agent.transfer(handle)
                except Exception as exc:
                    raise TransferError(f"READ from {name} failed ({_error_text(exc)})") from None
                if state == "ERR":
                    raise TransferError(f"READ from {name} failed (NIXL reported an error)")
            self._wait(handles, start + timeout_s, timeout_s)
        finally:
            for _, handle in handles:
                with contextlib.suppress(Exception):
                    handle.release()
        return time.perf_counter() - start

    def _wait(self, handles: list[tuple[str, Any]], deadline: float, timeout_s: float) -> None:
        pending = list(handles)
        spins = 0
        held = not os.environ.get(HOLD_ENV)
        while pending:
            name, handle = pending[0]
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception as exc:
                raise TransferError(f"READ from {name} failed ({_error_text(exc)})") from None
            if state == "DONE":
                pending.pop(0)
                continue
            if state == "ERR":
                raise TransferError(f"READ from {name} failed (NIXL reported an error)")
            if not held:
                held = True
                _hold_in_flight()
            if time.perf_counter() > deadline:
                raise TransferError(f"READ from {name} made no progress for {timeout_s:g} s")
            spins += 1
            if spins > 100:  # a long transfer: stop spinning a core the peer may need
                time.sleep(0.0002)

    def read_raw(self, name: str, device_id: int, src_addr: int, nbytes: int, timeout_s: float, memory: str) -> float:
        """Seconds to READ `nbytes` from `src_addr` of a remote region as one descriptor (the benchmark's baseline),
        into a scratch region of this agent's memory kind."""
        import torch

        if self._scratch is None or self._scratch[0] < nbytes:
            if self._scratch is not None:
                self._agent.deregister_memory(self._scratch[2])
            device = torch.device("cuda", self.device_id) if self.memory == "VRAM" else torch.device("cpu")
            buffer = torch.ones(nbytes, dtype=torch.uint8, device=device)  # touched: no page faults in the timing
            self._scratch = (nbytes, buffer, self._register(buffer.data_ptr(), nbytes))
        one = np.ones(1, dtype=np.int64)
        dst = one * self._scratch[1].data_ptr()
        return self.read([(name, device_id, one * src_addr, dst, one * nbytes)], timeout_s, memory)

    def close(self) -> None:
        """Stop the progress thread, drop the remotes and registrations, and destroy the NIXL agent (idempotent).

        An agent still alive when the interpreter finalizes can abort the process from UCX's threads
        ("terminate called without an active exception"), so every agent is also closed at exit.
        """
        if self._closed.is_set():
            return
        self._closed.set()
        if self._progress is not None:
            self._progress.join()
        for name in list(self._remotes):
            self.disconnect(name)
        with contextlib.suppress(Exception):
            for region in self._regions + ([self._scratch[2]] if self._scratch else []):
                self._agent.deregister_memory(region)
        self._regions, self._scratch, self._agent = [], None, None
        _open_agents.discard(self)


@atexit.register
def _close_open_agents() -> None:
    for agent in list(_open_agents):
        agent.close()
