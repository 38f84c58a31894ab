"""`kvgate emulate`: run one emulated vLLM / SGLang instance until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

from config.settings import PDProtocol, Role
from predictors.profiles import PROFILES
from replay.emulator.config import EmulatorConfig
from replay.emulator.server import start_emulator

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", choices=[r.value for r in Role], default=Role.BOTH.value)
    parser.add_argument(
        "--protocol",
        choices=[PDProtocol.VLLM.value, PDProtocol.SGLANG.value],
        default=PDProtocol.VLLM.value,
        help="P/D protocol and metric names to speak (default vllm)",
    )
    parser.add_argument(
        "--profile",
        default="llama3-8b-h100-tp1",
        choices=sorted(PROFILES),
        metavar="NAME",
        help="calibrated engine profile (default llama3-8b-h100-tp1)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per model second: 1 = real speed, 0.05 = 20x faster",
    )
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    parser.add_argument(
        "--kv-events-port", type=int, default=0, help="ZMQ PUB port for KV events (0 = off)"
    )
    parser.add_argument("--kv-events-format", choices=["array", "map"], default="array")
    parser.add_argument(
        "--link-gbps", type=float, default=200.0, help="KV transfer link bandwidth (Gbit/s)"
    )
    parser.add_argument(
        "--decode-tbt-limit-ms",
        type=float,
        default=None,
        help="refuse decodes whose step time would exceed this (503); default off",
    )
    parser.add_argument(
        "--model",
        nargs="+",
        default=None,
        metavar="NAME",
        help="served model name(s), as vLLM's --served-model-name (default: the profile)",
    )
    parser.add_argument(
        "--model-dir",
        default=None,
        help="HF model directory: tokenize prompts with its tokenizer and chat template "
        "(as the gateway's routing.model_dir); default: the approximate tokenizer",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME[=PATH]",
        help="serve these LoRA adapters, as vLLM's --lora-modules (the path is only hashed, "
        "as vLLM hashes it; no weights are read)",
    )
    parser.add_argument(
        "--max-loras",
        type=int,
        default=1,
        help="LoRA adapters one batch runs at once, as vLLM's --max-loras (default 1); a "
        "request for another adapter waits until a running adapter's requests have left",
    )
    parser.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="LoRA adapters kept in host memory, as vLLM's --max-cpu-loras (default: "
        "--max-loras); one that is not is read in first (--lora-load-s)",
    )
    parser.add_argument(
        "--lora-load-s",
        type=float,
        default=0.0,
        help="model seconds a step takes longer to read in an adapter not in host memory "
        "(default 0: loads are free)",
    )
    parser.add_argument(
        "--bootstrap-port",
        type=int,
        default=None,
        help="also serve the SGLang bootstrap endpoint on this port",
    )


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    return EmulatorConfig(
        role=Role(args.role),
        protocol=PDProtocol(args.protocol),
        profile=args.profile,
        host=args.host,
        port=args.port,
        time_scale=args.time_scale,
        block_size=args.block_size,
        kv_events_port=args.kv_events_port or None,  # the CLI's 0 means off
        kv_events_format=args.kv_events_format,
        link_gbps=args.link_gbps,
        decode_tbt_limit_ms=args.decode_tbt_limit_ms,
        model=args.model[0] if args.model else None,
        model_aliases=tuple(args.model[1:]) if args.model else (),
        model_dir=args.model_dir,
        bootstrap_port=args.bootstrap_port,
        lora_adapters=tuple(_lora_module(m) for m in args.lora_modules),
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        lora_load_s=args.lora_load_s,
    )


def _lora_module(spec: str) -> tuple[str, str]:
    """``name=path`` or ``name`` (the path then is the name)."""
    name, _, path = spec.partition("=")
    return name, path or name


async def _run(config: EmulatorConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # not on Windows
            loop.add_signal_handler(sig, stop.set)
    emulator = await start_emulator(config)
    extra = ""
    if emulator.kv_events_endpoint:
        extra += f", KV events {emulator.kv_events_endpoint} ({config.kv_events_format})"
    if emulator.bootstrap_port is not None:
        extra += f", bootstrap port {emulator.bootstrap_port}"
    log.info(
        "kvgate emulator %s (%s %s, profile %s, time scale %g) listening on %s%s",
        config.served_model,
        config.protocol.value,
        config.role.value,
        config.profile,
        config.time_scale,
        emulator.url,
        extra,
    )
    try:
        await stop.wait()
    finally:
        await emulator.stop()


def main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        config.validate()
        if config.model_dir:  # fail here, naming the file, not inside the event loop
            from backends.model_files import load_prompt_encoder

            load_prompt_encoder(config.model_dir)
    except (ValueError, KeyError) as exc:
        print(f"kvgate emulate: {exc}", file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        asyncio.run(_run(config))
    except OSError as exc:  # port in use, bad host
        print(f"kvgate emulate: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0
