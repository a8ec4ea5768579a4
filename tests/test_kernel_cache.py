"""The kernel build cache under concurrent starts: many processes starting at once on a cold cache build the library
once and all load it; on a warm cache they load it without the build lock or the compiler; a build killed while
holding the lock, or a holder stuck past STALE_LOCK_S, does not block later starts. Each test has its own HOME (its
own cache) and a compiler wrapper that logs every invocation, so a build is counted by its link step."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.kernels import cpu_kernels, shm_kernels
from engine.kernels.cpu_isa import detect

REPO = Path(__file__).resolve().parents[1]
STARTS = 8
# one start: build (or load) the shared-memory collectives (the smaller library) and call one of their ops
START = (
    "import sys, torch; from engine.kernels import cpu_kernels, shm_kernels; "
    "isa, name = cpu_kernels.build_for_cpu(shm_kernels.SOURCES, shm_kernels.LIBRARY); "
    "print(name if isa else 'FAILED ' + name); "
    "sys.exit(0 if isa and torch.ops.dcpctl_shm.segment_bytes(2, 64) > 0 else 1)"
)
LOCK_PROBE = """
#include <torch/library.h>
int64_t answer() { return 42; }
TORCH_LIBRARY(dcpctl_lock_test, m) { m.def("answer", &answer); }
"""


@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> Path:
    """A HOME of the test's own (an empty kernel cache) and CXX set to a wrapper that logs each invocation (its pid
    and arguments) to the returned file and, with DCPCTL_TEST_HANG set, hangs in place of each compile step."""
    real = shutil.which(cpu_kernels.compiler())
    if real is None:
        pytest.skip("no C++ compiler")
    log = tmp_path / "compiler.log"
    wrapper = tmp_path / "logging-c++"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'echo "$$ $*" >> {log}\n'
        'if [ -n "$DCPCTL_TEST_HANG" ]; then case " $* " in *" -c "*) exec sleep 600;; esac; fi\n'
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.delenv("DCPCTL_TEST_HANG", raising=False)
    return log


def _links(log: Path) -> int:
    """How many libraries the wrapper linked (one link per build)."""
    return sum(" -shared " in f" {line} " for line in log.read_text().splitlines()) if log.exists() else 0


def _published() -> Path:
    """Where this CPU's shared-memory build is published in the test's cache."""
    isa = detect()
    name = cpu_kernels.build_name(isa, shm_kernels.LIBRARY)
    return cpu_kernels.library_path(shm_kernels.SOURCES, name, cpu_kernels.build_flags(isa))


def _start_many(count: int) -> list[subprocess.Popen]:
    return [
        subprocess.Popen([sys.executable, "-c", START], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(count)
    ]


def _finish(starts: list[subprocess.Popen], timeout: float = 300) -> list[str]:
    """Each start's printed build name; every start must have loaded the library."""
    names = []
    for start in starts:
        out, err = start.communicate(timeout=timeout)
        assert start.returncode == 0, err.decode()[-3000:]
        names.append(out.decode().strip())
    return names


def test_the_key_covers_the_sources_bytes(tmp_path, monkeypatch):
    """A changed source is a new library path (the cache is never trusted across an edit); the same bytes elsewhere
    and other flags: same / different keys."""
    monkeypatch.setenv("HOME", str(tmp_path))
    source = tmp_path / "a.cpp"
    source.write_text("int f() { return 1; }\n")
    first = cpu_kernels.library_path((source,), "dcpctl_key_test", ["-O2"])
    assert first.parent == cpu_kernels.kernels_dir() / "dcpctl_key_test" and first.suffix == ".so"
    copy = tmp_path / "copy" / "a.cpp"
    copy.parent.mkdir()
    copy.write_bytes(source.read_bytes())
    assert cpu_kernels.library_path((copy,), "dcpctl_key_test", ["-O2"]) == first
    assert cpu_kernels.library_path((source,), "dcpctl_key_test", ["-O3"]) != first
    source.write_text("int f() { return 2; }\n")
    assert cpu_kernels.library_path((source,), "dcpctl_key_test", ["-O2"]) != first


@pytest.mark.slow
@pytest.mark.multiproc
def test_many_starts_at_once_build_once_cold_and_load_without_the_lock_warm(private_cache):
    """8 processes at once on a cold cache: all load, one link. Then 8 at once on the warm cache while the test
    holds the build lock: all load (a load takes no lock) and the compiler is not run at all."""
    names = _finish(_start_many(STARTS))
    assert len(set(names)) == 1 and names[0].startswith(shm_kernels.LIBRARY), names
    assert _links(private_cache) == 1, private_cache.read_text()
    library = _published()
    assert library.is_file() and [p.name for p in library.parent.glob("*.so")] == [library.name]
    assert not list(library.parent.glob("tmp-*")), "a private build folder was left behind"

    calls = len(private_cache.read_text().splitlines())
    with open(library.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert _finish(_start_many(STARTS), timeout=120) == names
    assert len(private_cache.read_text().splitlines()) == calls, "a warm start ran the compiler"


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_build_killed_holding_the_lock_is_taken_over(private_cache):
    """SIGKILL of a start in the middle of its build (the compiler hangs): the next start takes the lock at once,
    clears the killed build's leftover folder, builds, loads, and publishes the one library."""
    stuck = subprocess.Popen(
        [sys.executable, "-c", START],
        cwd=REPO,
        env={**os.environ, "DCPCTL_TEST_HANG": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not (private_cache.exists() and " -c " in private_cache.read_text()):
        assert time.monotonic() < deadline and stuck.poll() is None, "the stuck build never reached its compile step"
        time.sleep(0.2)
    os.killpg(stuck.pid, signal.SIGKILL)
    stuck.wait()
    for line in private_cache.read_text().splitlines():  # the hung compile steps: ninja gives them groups of their own
        if " -c " in f" {line} ":
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[0]), signal.SIGKILL)
    library = _published()
    [leftover] = library.parent.glob("tmp-*")
    old = time.time() - cpu_kernels.STALE_LOCK_S - 60
    os.utime(leftover, (old, old))

    started = time.monotonic()
    names = _finish(_start_many(1))
    assert names[0] == library.parent.name and library.is_file()
    assert _links(private_cache) == 1
    assert not leftover.exists()
    assert time.monotonic() - started < cpu_kernels.STALE_LOCK_S


@pytest.mark.slow
def test_a_holder_stuck_past_the_stale_time_is_built_around(private_cache, tmp_path, monkeypatch, caplog):
    """A lock held (by a live process) longer than STALE_LOCK_S: the start builds in its own folder anyway, says so
    in one warning, and loads its build."""
    monkeypatch.setattr(cpu_kernels, "STALE_LOCK_S", 1)
    source = tmp_path / "lock_probe.cpp"
    source.write_text(LOCK_PROBE)
    name = "dcpctl_lock_test"
    library = cpu_kernels.library_path((source,), name, cpu_kernels.BASE_CFLAGS)
    library.parent.mkdir(parents=True)
    with open(library.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert cpu_kernels.build_kernels((source,), name, cpu_kernels.BASE_CFLAGS) is None
    assert torch.ops.dcpctl_lock_test.answer() == 42 and library.is_file()
    [warning] = [r.getMessage() for r in caplog.records if r.name == cpu_kernels.__name__]
    assert warning == f"{library.parent / 'build.lock'} held for over 1 s: building without it"
