"""The engine emulator: a real HTTP server that behaves like vLLM / SGLang on the wire and takes
the time the calibrated engine model (replay.engine) says, optionally scaled down."""

from replay.emulator.config import EmulatorConfig
from replay.emulator.server import RunningEmulator, start_emulator

__all__ = ["EmulatorConfig", "RunningEmulator", "start_emulator"]
