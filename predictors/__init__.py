"""Timing predictors for kvgate: prefill (TTFT), decode step (TBT), KV transfer, output length.

Pure models: no I/O on the request path, no clocks, no globals. Files are read only by explicit
loaders (samples CSV, saved models) at startup or offline. All times are in seconds.
"""
