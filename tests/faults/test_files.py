"""probe's files are written atomically and exclusively: a planted symlink is never written
through, no temporary file is left, a failed write leaves the old file intact (real symlinks)."""

from __future__ import annotations

import os

import pytest

import probe
from probe.files import atomic_write


def test_a_planted_symlink_at_the_summary_path_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(victim, run / "probe_summary.json")
    probe.Summary({}, steps=3).save(run / "probe_summary.json")
    assert victim.read_text() == "precious"
    assert not os.path.islink(run / "probe_summary.json")
    assert probe.Summary.load(run).steps == 3
    assert sorted(os.listdir(run)) == ["probe_summary.json"]


def test_planted_symlinks_at_temporary_names_are_never_opened(tmp_path, monkeypatch):
    # Even a temporary name known in advance (here: forced) is refused when something is there:
    # O_EXCL | O_NOFOLLOW fails on an existing path or symlink, and a fresh random name is drawn.
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    names = iter(["aaaa", "aaaa", "bbbb"])
    monkeypatch.setattr("probe.files.secrets.token_hex", lambda n: next(names))
    os.symlink(victim, tmp_path / ".probe_summary.json.aaaa.tmp")
    atomic_write(tmp_path / "probe_summary.json", "{}")
    assert victim.read_text() == "precious"
    assert (tmp_path / "probe_summary.json").read_text() == "{}"
    assert os.path.islink(tmp_path / ".probe_summary.json.aaaa.tmp")  # left alone, not ours


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "probe_summary.json"
    atomic_write(target, "old")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        atomic_write(target, "new")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["probe_summary.json"]


def test_the_summary_keeps_the_users_umask_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "f.json", "{}")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "f.json").st_mode & 0o777 == 0o644
