"""Timing predictors for kvgate: prefill (TTFT), decode step (TBT), KV transfer, output length.

Pure models: no I/O, no clocks, no globals. Sample CSVs and saved models are read at the edge
(backends/predictor_files.py) and parsed here. All times are in seconds.
"""
