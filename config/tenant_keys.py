"""Client API keys of tenants: only SHA-256 hashes are stored, in the config or a keys file.

A keys file has one key per line, ``TENANT SHA256HEX`` (blank lines and ``#`` comments are
skipped), e.g. made with ``printf '%s' "$KEY" | sha256sum``. ``read_key_file`` checks it
whole and names the file and line of each mistake; the config check and the gateway both
read it through here, so a reload validates it exactly like start-up.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection
from pathlib import Path

from config.errors import KvgateError
from config.tenant_settings import TenantsSettings

_HEX64 = re.compile(r"[0-9a-f]{64}")


def hash_key(key: str) -> str:
    """The stored form of an API key: its SHA-256, lower-case hex."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def is_key_hash(text: str) -> bool:
    return _HEX64.fullmatch(text) is not None


class KeyFileError(KvgateError, ValueError):
    """A keys file that cannot be read or has a bad line (``line`` 0: the whole file)."""

    def __init__(self, path: str, line: int, message: str) -> None:
        self.path, self.line = path, line
        where = f"keys file {path}" + (f", line {line}" if line else "")
        super().__init__(f"{where}: {message}")


def parse_keys(text: str, path: str, tenants: Collection[str]) -> dict[str, str]:
    """Key hash -> tenant; every line checked, the first bad one raises ``KeyFileError``."""
    out: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise KeyFileError(path, n, f"expected 'TENANT SHA256HEX', got {len(parts)} fields")
        tenant, digest = parts[0], parts[1].lower()
        if not is_key_hash(digest):
            raise KeyFileError(path, n, "the key must be a SHA-256 hash (64 hex digits)")
        if tenant not in tenants:
            known = ", ".join(sorted(tenants)) or "none"
            raise KeyFileError(path, n, f"tenant {tenant!r} is not defined (tenants: {known})")
        if digest in out:
            raise KeyFileError(path, n, f"duplicate key (also on line {first_line[digest]})")
        out[digest], first_line[digest] = tenant, n
    return out


def read_key_file(path: str, tenants: Collection[str]) -> dict[str, str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise KeyFileError(path, 0, f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise KeyFileError(path, 0, "not valid UTF-8") from None
    return parse_keys(text, path, tenants)


def tenant_keys(cfg: TenantsSettings) -> dict[str, str]:
    """Key hash -> tenant, from the config's ``key_sha256`` lists and the keys file (read here:
    call it where file I/O belongs, at start-up or off the event loop on reload)."""
    keys = {d.lower(): t.name for t in cfg.tenant for d in t.key_sha256}
    if cfg.keys_file is not None:
        keys.update(read_key_file(cfg.keys_file, set(cfg.names())))
    return keys
