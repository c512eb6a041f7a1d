"""The scheduler's side of the engine, on host data alone (no JAX): requests, the five-phase scheduler, the KV
cache's block pools and prefix cache, and the step contract it hands the worker (scheduler_output.py)."""
