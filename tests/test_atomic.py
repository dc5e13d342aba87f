"""Atomic writes: a reader sees the old file or the whole new one, never a part, and no temp file stays."""
import pytest

from workbench.atomic import atomic_path, atomic_write


def test_a_write_replaces_the_file_whole(tmp_path):
    path = tmp_path / "sub" / "out.json"
    atomic_write(path, "old")
    atomic_write(path, b"new")
    assert path.read_text() == "new" and [p.name for p in path.parent.iterdir()] == ["out.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "out.bin"
    atomic_write(path, b"old")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("the writer failed")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["out.bin"]
