"""Atomic file writes: a result file is either complete or absent, never half-written.

A symlink at the output path is followed (its target is written atomically, the link stays); an existing
path that is not a regular file (a folder, a device such as /dev/full, a FIFO) is refused with a UserError,
never replaced. `writable_file` / `writable_folder` check an output location before any work is done.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from engine.errors import UserError


def _resolved(path: str | os.PathLike) -> Path:
    """`path`, or the file a symlink there points to (chains followed)."""
    target = Path(path)
    return Path(os.path.realpath(target)) if target.is_symlink() else target


def _regular_target(path: str | os.PathLike, what: str) -> Path:
    """The file to write for `path`; a UserError when something other than a regular file is there."""
    target = _resolved(path)
    if target.is_dir():
        raise UserError(f"{what} {path} is a folder: give a file path inside it")
    if target.exists() and not target.is_file():
        raise UserError(f"{what} {path} exists and is not a regular file (a device, FIFO or socket): give a file path")
    return target


def _probe_folder(folder: Path, path: str | os.PathLike, what: str) -> None:
    """A UserError unless a file can be created in `folder` or, when it does not exist yet, its nearest ancestor."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{what} {path}: {existing} is a file, not a folder; choose another location")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".dcpctl-probe.")
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UserError(f"{what} {path}: cannot write in {existing} ({reason}); choose another location") from None
    os.close(fd)
    os.unlink(probe)


def writable_file(path: str | os.PathLike, what: str = "output") -> None:
    """Check, before any work, that `path` can take an atomic write (a UserError naming `what` if not)."""
    target = _regular_target(path, what)
    _probe_folder(target.parent, path, what)


def writable_folder(path: str | os.PathLike, what: str = "output") -> None:
    """Check, before any work, that files can be written in the folder `path` (created if absent)."""
    folder = Path(os.path.realpath(path))
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{what} {path} is a file, not a folder; give a folder path")
    _probe_folder(folder, path, what)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` (a symlink's target) through a temporary file in the same folder and a rename."""
    target = _regular_target(path, "output")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))
