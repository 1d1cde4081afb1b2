"""Serving: engine (FIFO over the run-ahead Generator), Starlette app, launch CLI (`python -m serve.launch_server`)."""
