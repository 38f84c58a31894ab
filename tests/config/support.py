"""Shared by the config loader tests: a two-pool fleet and error assertions."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from config import ConfigError, load_settings

WriteToml = Callable[[str], Path]

POOLS = """
[[pools]]
name = "prefill"
role = "prefill"

[[pools.instances]]
id = "p0"
url = "http://127.0.0.1:8101"

[[pools]]
name = "decode"
role = "decode"

[[pools.instances]]
id = "d0"
url = "http://127.0.0.1:8102"
"""


def load_error(path: Path | None, env: Mapping[str, str] | None = None, **kw: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_settings(path, env=env or {}, **kw)
    return info.value


def assert_names(err: ConfigError, path: Path, key: str) -> None:
    """The first error is about ``key`` in ``path``, and the message says so."""
    assert err.source == str(path)
    assert err.key == key
    first_line = str(err).splitlines()[0]
    assert first_line.startswith(f"{path}: {key}")
