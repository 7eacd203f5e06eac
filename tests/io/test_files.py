"""A file or a directory replaced whole (rayrb/io/files.py): a crash or a failing writer leaves the old one or the
new one, never part of either, and nothing beside it. No Ray."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from rayrb.io import files
from rayrb.io.files import replace_dir, replace_file


def names(d):
    return sorted(p.name for p in d.iterdir())


class Boom(RuntimeError):
    pass


def test_a_file_is_replaced_whole_and_a_failing_write_leaves_the_old_one(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    replace_file(path, "old")
    replace_file(path, b"new", sync=True)
    assert path.read_text() == "new" and names(tmp_path) == ["state.json"]

    def fail(*a):
        raise Boom("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(Boom):
        replace_file(path, "newer")
    assert path.read_text() == "new" and names(tmp_path) == ["state.json"]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_a_directory_is_swapped_in_whole(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(files, "_RENAMEAT2", None)
    elif files._RENAMEAT2 is None:
        pytest.skip("no renameat2 here")
    dest = tmp_path / "ds"
    replace_dir(dest, lambda d: (d / "a").write_text("1"))  # none there before
    seen = []

    def write(d):
        seen.append(names(dest))  # while the new one is built, readers see the old one whole
        (d / "b").write_text("2")

    assert replace_dir(dest, write) == dest
    assert seen == [["a"]] and names(dest) == ["b"] and names(tmp_path) == ["ds"]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_a_failing_writer_leaves_the_old_directory_and_nothing_beside_it(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(files, "_RENAMEAT2", None)
    dest = tmp_path / "ds"
    replace_dir(dest, lambda d: (d / "a").write_text("1"))

    def write(d):
        (d / "half").write_text("x")
        raise Boom("writer died")

    with pytest.raises(Boom):
        replace_dir(dest, write)
    assert names(dest) == ["a"] and names(tmp_path) == ["ds"]
    with pytest.raises(Boom):
        replace_dir(tmp_path / "new", write)  # nothing before: nothing after
    assert names(tmp_path) == ["ds"]


def refuse_renames_onto(dest, monkeypatch, error, only_from=""):
    """Without renameat2, ``os.rename`` onto ``dest`` (from a path containing ``only_from``) raises ``error``."""
    monkeypatch.setattr(files, "_RENAMEAT2", None)
    real = os.rename

    def rename(src, dst):
        if str(dst) == str(dest) and only_from in str(src):
            raise error
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)


def test_a_failed_second_rename_puts_the_old_directory_back(tmp_path, monkeypatch):
    dest = tmp_path / "ds"
    replace_dir(dest, lambda d: (d / "a").write_text("1"))
    refuse_renames_onto(dest, monkeypatch, Boom("rename failed"), only_from=".tmp-")  # the new one's, into place
    with pytest.raises(Boom):
        replace_dir(dest, lambda d: (d / "b").write_text("2"))
    assert names(dest) == ["a"] and names(tmp_path) == ["ds"]


def test_a_crash_between_the_renames_leaves_the_old_directory_beside_it(tmp_path, monkeypatch):
    """Without renameat2 there is a moment with no directory at ``dest``: a crash then keeps the old one aside."""
    dest = tmp_path / "ds"
    replace_dir(dest, lambda d: (d / "a").write_text("1"))
    refuse_renames_onto(dest, monkeypatch, KeyboardInterrupt())  # stands for the process dying before the rename
    with pytest.raises(KeyboardInterrupt):
        replace_dir(dest, lambda d: (d / "b").write_text("2"))
    # the put-back rename was refused too (the same stand-in): the old directory waits beside, whole
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(".ds.old-")]
    assert not dest.exists() and len(aside) == 1 and names(aside[0]) == ["a"]


def test_renameat2_exchange_swaps_two_directories(tmp_path):
    if files._RENAMEAT2 is None:
        pytest.skip("no renameat2 here")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "x").write_text("a"), (b / "y").write_text("b")
    assert files._exchange(a, b) and names(a) == ["y"] and names(b) == ["x"]
    assert not files._exchange(a, tmp_path / "absent")  # nothing to swap with: the caller renames


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_a_linked_directory_is_replaced_through_the_link_on_its_own_file_system(tmp_path, monkeypatch, exchange):
    """The link stays a link, the directory it leads to is swapped beside itself (on /dev/shm where there is one,
    another file system than tmp_path's), and nothing is left beside the link."""
    if not exchange:
        monkeypatch.setattr(files, "_RENAMEAT2", None)
    elif files._RENAMEAT2 is None:
        pytest.skip("no renameat2 here")
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    real_parent = Path(tempfile.mkdtemp(dir=base))
    try:
        real = real_parent / "data"
        replace_dir(real, lambda d: (d / "a").write_text("1"))
        link = tmp_path / "link"
        link.symlink_to(real)
        assert replace_dir(link, lambda d: (d / "b").write_text("2")) == link
        assert link.is_symlink() and os.readlink(link) == str(real)
        assert names(real) == ["b"] and names(tmp_path) == ["link"] and names(real_parent) == ["data"]
        assert (real / "b").stat().st_dev == real_parent.stat().st_dev
    finally:
        shutil.rmtree(real_parent, ignore_errors=True)
