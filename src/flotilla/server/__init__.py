"""``flotilla server``: one long-lived local HTTP server over the command line's state.

``control`` starts, stops and reports the server (standard library only: the command line
imports it without the ``server`` extra); ``api`` reads clusters, jobs, managed jobs,
pools, events and metrics from the files the CLI and its daemons keep, and runs the
actions through the CLI itself; ``app`` is the ASGI application (Starlette, served by
uvicorn: ``pip install 'flotilla[server]'``) with the routes of ``routes`` and the
dashboard in ``static/``. See docs/server.md.
"""
