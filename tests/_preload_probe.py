"""A module a test plugin names in its ``preload`` (tests/test_plugins.py): it records which
process imported it and what that process's environment held then."""

import os

PID = os.getpid()
ENV = os.environ.get("PRELOAD_PROBE")
