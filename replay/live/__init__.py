"""Live tools: load generation against a running gateway or engine."""
