"""The OpenAI-compatible HTTP server: python -m minfer.serve. protocol.py the request and response shapes,
async_engine.py the thread that steps the engine core, api.py the routes, metrics.py the Prometheus
series, __main__.py the command line."""
