"""Fails in the agent's preload thread (a failure of the moment), imports elsewhere."""

import threading

if threading.current_thread().name == "preload":
    raise ImportError("a failure of the agent's preload")
