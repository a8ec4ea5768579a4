"""engine.io_utils: atomic writes follow symlinks, never replace a non-regular file; output checks before work."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.errors import UserError
from engine.io_utils import atomic_write_text, writable_file, writable_folder


def test_symlink_target_is_written_and_the_link_kept(tmp_path):
    real = tmp_path / "real.jsonl"
    real.write_text("old")
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    assert atomic_write_text(link, "new") == link
    assert link.is_symlink() and real.read_text() == "new"


def test_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "link.jsonl"
    link.symlink_to(tmp_path / "made.jsonl")
    atomic_write_text(link, "x")
    assert link.is_symlink() and (tmp_path / "made.jsonl").read_text() == "x"


@pytest.mark.skipif(not Path("/dev/null").is_char_device(), reason="needs /dev/null")
@pytest.mark.parametrize("check", [lambda p: atomic_write_text(p, "x"), writable_file])
def test_device_and_fifo_are_refused_never_replaced(tmp_path, check):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "null-link"
    link.symlink_to("/dev/null")
    for path in (fifo, Path("/dev/null"), link):
        with pytest.raises(UserError, match="not a regular file"):
            check(path)
    assert Path("/dev/null").is_char_device() and fifo.is_fifo()


def test_folder_is_refused_as_a_file(tmp_path):
    with pytest.raises(UserError, match="is a folder"):
        atomic_write_text(tmp_path, "x")
    with pytest.raises(UserError, match="is a folder"):
        writable_file(tmp_path, "--output")


def test_writable_file_and_folder(tmp_path):
    writable_file(tmp_path / "new" / "deeper" / "out.jsonl")
    writable_folder(tmp_path / "new" / "dir")
    assert list(tmp_path.iterdir()) == []  # the checks create nothing
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(UserError, match="is a file, not a folder"):
        writable_folder(afile, "--output")
    with pytest.raises(UserError, match="is a file, not a folder"):
        writable_file(afile / "out.jsonl", "--output")


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs /proc")
def test_unwritable_location_is_named(tmp_path):
    with pytest.raises(UserError, match=r"--output /proc/x.jsonl: cannot write in /proc"):
        writable_file("/proc/x.jsonl", "--output")
    with pytest.raises(UserError, match=r"cannot write in /proc"):
        writable_folder("/proc/b", "--output")
