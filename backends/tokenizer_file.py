"""``FileTokenizer``: a tokenizer read from the engine's ``tokenizer.json`` (the edge: the core's
``routing.tokenizer`` holds the ``Tokenizer`` protocol and the file-free approximation)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from routing.tokenizer import ApproxTokenizer, Tokenizer


class FileTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a ``tokenizer.json``.

    Encodes without special tokens: the chat template / BOS handling belongs to the engine, and
    adding them here would shift every block boundary relative to what the engine caches.
    """

    __slots__ = ("_path", "_tok")

    def __init__(self, path: str | Path) -> None:
        try:
            # Lazy: the package is an optional extra (kvgate[tokenizer]).
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "routing.tokenizer_file needs the 'tokenizers' package: "
                "pip install 'kvgate[tokenizer]' (or unset tokenizer_file to use the "
                "approximate tokenizer)"
            ) from exc
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {p}")
        try:
            self._tok: Any = HFTokenizer.from_file(str(p))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON / models
            raise ValueError(f"cannot load tokenizer file {p}: {exc}") from exc
        self._path = p

    @property
    def path(self) -> Path:
        return self._path

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return ids

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def __repr__(self) -> str:
        return f"FileTokenizer({str(self._path)!r})"


def load_tokenizer(path: str | None, chars_per_token: float = 4.0) -> Tokenizer:
    """The tokenizer ``RoutingSettings`` asks for: the file if set, else the approximation."""
    if path:
        return FileTokenizer(path)
    return ApproxTokenizer(chars_per_token)
