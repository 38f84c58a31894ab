"""Fixtures of the config tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.config.support import WriteToml


@pytest.fixture
def write_toml(tmp_path: Path) -> WriteToml:
    def write(text: str) -> Path:
        path = tmp_path / "kvgate.toml"
        path.write_text(text, encoding="utf-8")
        return path

    return write
