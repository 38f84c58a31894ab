"""Pure engine model: what a vLLM or SGLang instance does with time (simulator + emulator)."""
