"""Reporting: run results, summaries, plots, prediction errors and progress output."""
