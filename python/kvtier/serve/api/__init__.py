"""``kvtier serve``: an OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn).

- :mod:`.protocol`: request bodies, validation, the OpenAI error shape.
- :mod:`.worker`: the engine thread; :mod:`.jobs`: per-request streaming state.
- :mod:`.sessions`: session encoders, tool waits, idle TTL.
- :mod:`.responses`: response bodies and stream chunks; :mod:`.metrics`: ``/metrics``.
- :mod:`.app`: the routes; :mod:`.server`: building and running it.
"""
