"""Integration tests against real engines (vLLM, llama.cpp), marked real_engine."""
