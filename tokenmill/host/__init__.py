"""Many models in one server, as Ollama serves them: ``tokenmill serve`` without a model.

A light process (no torch, no engine: like the router) answers every route for every model
``tokenmill models`` lists. A request's ``model`` picks one; the first request for a model
starts its runner, a ``tokenmill serve MODEL`` subprocess on a local port (as Ollama starts
one runner a model), and the request is proxied to it once it is up (router/proxy.py). An
idle runner stops when its keep_alive runs out (Ollama's field and default, 5 minutes), or
to make room: ``--max-loaded-models`` and a memory budget, the least recently used idle one
first, never one with requests in flight. A stopped runner's memory goes back to the machine
whole, with its process.

    config.py      HostConfig (the flags)
    keep_alive.py  Ollama's keep_alive values (durations, 0, negative)
    pool.py        the runners: start, wait until up, lease, evict, reap
    app.py         the routes (proxied by model; /v1/models, /api/tags, /api/ps answered here)
    launcher.py    the uvicorn server and its shutdown (every runner stops)
"""

from __future__ import annotations
