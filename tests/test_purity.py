"""routing/ and predictors/ are the pure core shared by the gateway and the simulator: no files,
sockets, clocks, processes or printing. Parsed with ast (not grepped), so an aliased or lazy
import inside a function counts as much as a top-level one."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ("routing", "predictors")

# Modules whose import alone means I/O, a clock, processes or an event loop.
BANNED_MODULES = frozenset(
    {
        "aiohttp", "asyncio", "glob", "http", "httpx", "io", "os", "pathlib", "requests",
        "select", "selectors", "shutil", "signal", "socket", "ssl", "starlette", "subprocess",
        "sys", "tempfile", "threading", "time", "urllib", "zmq",
    }
)  # fmt: skip
BANNED_BUILTINS = frozenset({"open", "print", "input", "exit", "quit", "breakpoint"})
# Methods that touch the filesystem whatever object they hang off (Path and friends).
BANNED_METHODS = frozenset(
    {"open", "read_text", "read_bytes", "write_text", "write_bytes", "iterdir", "unlink", "mkdir"}
)
# Clock reads through a module or class name: time is always an argument in the core.
BANNED_ATTRIBUTES = frozenset(
    {("datetime", "now"), ("datetime", "utcnow"), ("datetime", "today"), ("date", "today")}
)

# (file, import) pairs that are truly needed, each with the reason.
ALLOWED = {
    # sys.byteorder only: the token packer's endianness, a constant of the interpreter.
    ("routing/tokenizer.py", "sys"),
}


def violations(source: str, rel: str) -> list[str]:
    """Every banned use in one module's source, as ``file:line what``."""
    out: list[str] = []
    for node in ast.walk(ast.parse(source)):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
        for module in modules:
            top = module.split(".")[0]
            if top in BANNED_MODULES and (rel, top) not in ALLOWED:
                out.append(f"{rel}:{node.lineno} imports {module}")
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in BANNED_BUILTINS:
            out.append(f"{rel}:{node.lineno} calls {func.id}()")
        elif isinstance(func, ast.Attribute):
            if func.attr in BANNED_METHODS:
                out.append(f"{rel}:{node.lineno} calls .{func.attr}()")
            owner = func.value
            if isinstance(owner, ast.Name) and (owner.id, func.attr) in BANNED_ATTRIBUTES:
                out.append(f"{rel}:{node.lineno} calls {owner.id}.{func.attr}()")
    return out


def test_pure_core_does_no_io_and_reads_no_clock() -> None:
    bad = []
    for pkg in CORE:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            bad += violations(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert bad == []


def test_the_check_catches_each_kind_of_use() -> None:
    """The checker itself: each line below is one violation (so the test above can fail)."""
    source = "\n".join(
        [
            "import os",
            "import time as clock",
            "from socket import socket",
            "from pathlib import Path",
            "import urllib.request",
            "def f(p):",
            "    import subprocess",
            "    open('x')",
            "    print('x')",
            "    p.read_text()",
            "    p.write_bytes(b'')",
            "    p.open()",
            "    datetime.now()",
        ]
    )
    found = violations(source, "routing/x.py")
    assert [v.split(" ", 1)[0] for v in found] == [
        f"routing/x.py:{n}" for n in (1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 13)
    ]
    assert "routing/x.py:2 imports time" in found


def test_the_allow_list_is_per_file() -> None:
    assert violations("import sys", "routing/tokenizer.py") == []
    assert violations("import sys", "routing/conductor.py") == [
        "routing/conductor.py:1 imports sys"
    ]
