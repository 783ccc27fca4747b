"""deepspec.utils.fs.atomic_write / atomic_dir: the one temp-file (temp-directory) + os.replace writers the
stages share."""
from __future__ import annotations

import errno
import os

import pytest

from deepspec.utils import fs


def test_atomic_write_bytes_and_text(tmp_path):
    p = tmp_path / "a.json"
    fs.atomic_write(p, b"\x00\x01", sync_dir=True)
    assert p.read_bytes() == b"\x00\x01"
    fs.atomic_write(p, "héllo\n", fsync=False, tmp=tmp_path / "a.json.tmp")
    assert p.read_text() == "héllo\n"
    assert sorted(os.listdir(tmp_path)) == ["a.json"]     # no temp file left


@pytest.mark.parametrize("fsync", [True, False])
def test_atomic_write_failure_keeps_old_file_and_names_it(tmp_path, monkeypatch, fsync):
    p = tmp_path / "b.json"
    p.write_text("old")

    def replace(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError) as ei:
        fs.atomic_write(p, "new", fsync=fsync)
    assert ei.value.errno == errno.ENOSPC and str(p) in str(ei.value)
    assert p.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["b.json"]


def test_atomic_dir_replaces_on_success_only(tmp_path):
    out = tmp_path / "sub" / "out"
    with fs.atomic_dir(out) as tmp:
        assert tmp.parent == out.parent and tmp.name.startswith(".out.")
        (tmp / "a").write_text("1")
    assert [p.name for p in out.iterdir()] == ["a"]
    with pytest.raises(RuntimeError):
        with fs.atomic_dir(out, prefix=".x-") as tmp:
            (tmp / "b").write_text("2")
            raise RuntimeError("boom")
    assert [p.name for p in out.iterdir()] == ["a"]                  # the old directory is untouched
    assert sorted(os.listdir(out.parent)) == ["out"]                 # no temp directory left
    with fs.atomic_dir(out) as tmp:
        (tmp / "c").write_text("3")
    assert [p.name for p in out.iterdir()] == ["c"]                  # replaced as a whole


def test_jsonl_line_survives_every_line_splitter():
    import json
    from deepspec.utils.fs import jsonl_line
    rec = {"raw": "a\x85b\u2028c\u2029d\ne", "t": "héllo"}
    line = jsonl_line(rec)
    assert len(line.splitlines()) == 1 and "héllo" in line       # one record per line, UTF-8 kept
    assert json.loads(line) == rec
