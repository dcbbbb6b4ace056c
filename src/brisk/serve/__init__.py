"""The OpenAI-compatible server: `brisk serve` (app.py), its engine loop (async_engine.py), protocol models
(protocol.py), response building (responses.py), metrics (metrics.py), and a subprocess launcher for tests and
load benchmarks (process.py). Import from the submodules; this package imports nothing heavy itself."""
