"""kvgate's index of the llama.cpp slot files it saved: one JSON sidecar per file with the block
keys of the prefix the file holds.

llama-server writes a slot file (``kvgate-<end key>.bin``, gateway/slot_files.py) with tokens
and KV, but not kvgate's block keys, and kvgate may tokenize differently from the engine (the
approximate tokenizer), so the keys cannot be rebuilt from the file. Beside each file kvgate
writes ``kvgate-<end key>.json`` (``{"format": FORMAT, "blocks": [...]}``); a gateway that
starts on a directory with files in it (a restart, an upgrade) reads the sidecars and takes
the files over, instead of leaving them on disk unused and outside the bound; gateway replicas
sharing the directory rescan it to see each other's files come and go. Keys are content
hashes seeded per model name (routing/hashing.py, gateway/models.py): a file saved under
another model, block size or tokenizer only holds keys no request of this gateway matches,
and ages out of the bound like any unused file.

Synchronous file I/O: the gateway calls these in a worker thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

FORMAT = "kvgate-slot-file/1"
_NAME = re.compile(r"^kvgate-([0-9a-f]{16})\.(bin|json|json\.tmp)$")


def slot_file_name(key: int) -> str:
    """The slot file that holds the prefix ending with block ``key``."""
    return f"kvgate-{key & ((1 << 64) - 1):016x}.bin"


def sidecar_name(filename: str) -> str:
    return filename.removesuffix(".bin") + ".json"


@dataclass(frozen=True, slots=True)
class IndexedFile:
    key: int  # the prefix's end key (the file's name)
    filename: str
    blocks: tuple[int, ...]  # the prefix's block keys, the last one ``key``
    mtime: float  # of the slot file: the scan returns the least recently written first


@dataclass(frozen=True, slots=True)
class SlotDirScan:
    files: tuple[IndexedFile, ...]  # new slot files with a valid sidecar, oldest first
    present: frozenset[str]  # every slot file of kvgate's in the directory (not sidecars)
    # kvgate's files that cannot be taken over (a slot file without a valid sidecar, a sidecar
    # without its slot file, an unfinished sidecar), older than the scan's ``orphan_age_s``
    orphans: tuple[str, ...]


def write_sidecar(directory: str, filename: str, blocks: tuple[int, ...]) -> None:
    """Write ``filename``'s sidecar atomically (a reader never sees half of one)."""
    path = os.path.join(directory, sidecar_name(filename))
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "blocks": list(blocks)}, f)
    os.replace(tmp, path)


def remove_files(directory: str, names: Iterable[str]) -> None:
    """Delete files of ``directory`` (any may be gone already: another replica's bound)."""
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))


def _read_blocks(path: str, key: int) -> tuple[int, ...] | None:
    """The sidecar's keys, or None if it is not one of ours or does not end with ``key``."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return None
    blocks = doc.get("blocks")
    if not isinstance(blocks, list) or not blocks:
        return None
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks):
        return None
    if blocks[-1] & ((1 << 64) - 1) != key:
        return None
    return tuple(blocks)


def scan_slot_dir(
    directory: str, orphan_age_s: float, known: frozenset[str] = frozenset()
) -> SlotDirScan:
    """kvgate's slot files in ``directory``; other files are not looked at, nor the sidecars
    of ``known`` slot files (taken over already). Raises OSError if the directory cannot be
    listed."""
    now = time.time()
    mtimes: dict[str, float] = {}
    with os.scandir(directory) as it:
        for entry in it:
            if _NAME.match(entry.name) and entry.is_file(follow_symlinks=False):
                try:
                    mtimes[entry.name] = entry.stat(follow_symlinks=False).st_mtime
                except OSError:  # deleted meanwhile (another replica's bound)
                    continue
    files: list[IndexedFile] = []
    adopted: set[str] = set()
    for name, mtime in mtimes.items():
        m = _NAME.match(name)
        if m is None or m.group(2) != "bin" or sidecar_name(name) not in mtimes:
            continue
        if name in known:
            adopted |= {name, sidecar_name(name)}
            continue
        key = int(m.group(1), 16)
        blocks = _read_blocks(os.path.join(directory, sidecar_name(name)), key)
        if blocks is not None:
            files.append(IndexedFile(key, name, blocks, mtime))
            adopted |= {name, sidecar_name(name)}
    # A slot file is written by the engine before kvgate writes its sidecar: only an old
    # orphan is one whose writer is gone.
    orphans = sorted(n for n, t in mtimes.items() if n not in adopted and now - t > orphan_age_s)
    files.sort(key=lambda f: (f.mtime, f.filename))
    present = frozenset(n for n in mtimes if n.endswith(".bin"))
    return SlotDirScan(tuple(files), present, tuple(orphans))
