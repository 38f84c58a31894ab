"""`kvgate emulate` glue: argument parsing and a real process that stops cleanly on SIGTERM."""

from __future__ import annotations

import argparse
import re
import shlex
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from config.settings import PDProtocol, Role
from replay.emulator.cli import add_arguments, config_from_args, main

ROOT = Path(__file__).resolve().parents[3]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_arguments_map_to_the_config() -> None:
    argv = shlex.split(
        "--role decode --protocol sglang --profile llama2-7b-h100-tp1 --port 0 "
        "--time-scale 0.05 --kv-events-port 0 --kv-events-format map --link-gbps 100 "
        "--decode-tbt-limit-ms 50 --model m --bootstrap-port 8998 --lora-modules tl=/a/tl sql "
        "--max-loras 2 --max-cpu-loras 3 --lora-load-s 0.2"
    )
    cfg = config_from_args(parse(*argv))
    assert cfg.role is Role.DECODE and cfg.protocol is PDProtocol.SGLANG
    assert cfg.kv_events_port is None  # the CLI's 0 means off
    assert cfg.kv_events_format == "map" and cfg.decode_tbt_limit_ms == 50
    assert cfg.served_model == "m" and cfg.bootstrap_port == 8998 and cfg.host == "127.0.0.1"
    assert cfg.lora_adapters == (("tl", "/a/tl"), ("sql", "sql"))  # vLLM's NAME=PATH, or NAME
    assert cfg.max_loras == 2 and cfg.max_cpu_loras == 3 and cfg.lora_load_s == 0.2
    default = config_from_args(parse())
    assert default.served_model == default.profile and default.role is Role.BOTH
    with pytest.raises(SystemExit):
        parse("--profile", "nope")
    assert main(parse("--time-scale", "0")) == 2
    assert main(parse("--model", "m", "--lora-modules", "m")) == 2  # the model's own name
    assert main(parse("--lora-modules", "a", "--max-loras", "0")) == 2
    assert main(parse("--lora-modules", "a", "--max-loras", "2", "--max-cpu-loras", "1")) == 2


def test_process_serves_and_stops_on_sigterm() -> None:
    script = (
        "import argparse, sys\n"
        "from replay.emulator.cli import add_arguments, main\n"
        "p = argparse.ArgumentParser(); add_arguments(p)\n"
        "sys.exit(main(p.parse_args(sys.argv[1:])))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, "--port", "0", "--time-scale", "0.01"],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(20, proc.kill)  # never hang the suite
    watchdog.start()
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        assert match, line
        with urllib.request.urlopen(f"{match.group(1)}/health", timeout=5) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
