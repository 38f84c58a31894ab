"""kvgate's key sidecars of llama.cpp slot files (backends/llamacpp_slot_index.py): written
atomically, read back by a scan that takes over only consistent pairs, oldest first, and names
kvgate's leftovers once they are old enough to have no writer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from backends.llamacpp_slot_index import (
    FORMAT,
    remove_files,
    scan_slot_dir,
    sidecar_name,
    slot_file_name,
    write_sidecar,
)

A = (11, 12, 13)
B = (21, 22)


def _save(d: Path, blocks: tuple[int, ...], mtime: float | None = None) -> str:
    """A slot file as llama-server writes it, and kvgate's sidecar."""
    name = slot_file_name(blocks[-1])
    (d / name).write_bytes(b"kv")
    write_sidecar(str(d), name, blocks)
    if mtime is not None:
        os.utime(d / name, (mtime, mtime))
        os.utime(d / sidecar_name(name), (mtime, mtime))
    return name


def _age(d: Path, name: str, seconds: float) -> None:
    t = (d / name).stat().st_mtime - seconds
    os.utime(d / name, (t, t))


def test_a_saved_file_is_found_with_its_keys_oldest_first(tmp_path: Path) -> None:
    b = _save(tmp_path, B, mtime=2_000_000_000)
    a = _save(tmp_path, A, mtime=1_000_000_000)
    scan = scan_slot_dir(str(tmp_path), orphan_age_s=60)
    assert [(f.filename, f.key, f.blocks) for f in scan.files] == [(a, A[-1], A), (b, B[-1], B)]
    assert scan.orphans == ()
    doc = json.loads((tmp_path / sidecar_name(a)).read_text())
    assert doc == {"format": FORMAT, "blocks": list(A)}
    assert not list(tmp_path.glob("*.tmp"))  # written through a temporary, then renamed


def test_files_that_cannot_be_taken_over_are_leftovers_once_old(tmp_path: Path) -> None:
    lone_bin = slot_file_name(31)
    (tmp_path / lone_bin).write_bytes(b"kv")  # no sidecar (an older kvgate's, or a crash)
    lone_json = sidecar_name(slot_file_name(41))
    write_sidecar(str(tmp_path), slot_file_name(41), (41,))  # its slot file is gone
    wrong_end = _save(tmp_path, (51, 52))
    (tmp_path / sidecar_name(wrong_end)).write_text(json.dumps({"format": FORMAT, "blocks": [9]}))
    garbage = _save(tmp_path, (61,))
    (tmp_path / sidecar_name(garbage)).write_text("[1, 2")
    foreign = _save(tmp_path, (71,))
    (tmp_path / sidecar_name(foreign)).write_text(json.dumps({"blocks": [71]}))
    unfinished = sidecar_name(slot_file_name(81)) + ".tmp"
    (tmp_path / unfinished).write_text("{")
    (tmp_path / "someone-elses.bin").write_bytes(b"x")  # not kvgate's: never touched
    young = scan_slot_dir(str(tmp_path), orphan_age_s=60)
    assert young.files == () and young.orphans == ()  # a save may be under way
    for p in tmp_path.iterdir():
        _age(tmp_path, p.name, 120)
    old = scan_slot_dir(str(tmp_path), orphan_age_s=60)
    assert old.files == ()
    assert set(old.orphans) == {
        lone_bin,
        lone_json,
        wrong_end,
        sidecar_name(wrong_end),
        garbage,
        sidecar_name(garbage),
        foreign,
        sidecar_name(foreign),
        unfinished,
    }
    remove_files(str(tmp_path), old.orphans)
    remove_files(str(tmp_path), old.orphans)  # gone already: no error
    assert [p.name for p in tmp_path.iterdir()] == ["someone-elses.bin"]


def test_a_directory_that_cannot_be_listed_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        scan_slot_dir(str(tmp_path / "missing"), orphan_age_s=60)


def test_a_rescan_names_what_is_there_and_reads_only_new_sidecars(tmp_path: Path) -> None:
    a = _save(tmp_path, A)
    b = _save(tmp_path, B)
    (tmp_path / sidecar_name(a)).write_text("not read: a is known")
    young = slot_file_name(91)
    (tmp_path / young).write_bytes(b"kv")  # its sidecar is still being written
    scan = scan_slot_dir(str(tmp_path), orphan_age_s=60, known=frozenset({a}))
    assert [f.filename for f in scan.files] == [b]
    assert scan.present == {a, b, young}
    assert scan.orphans == ()
