"""A module whose import takes longer than a pool's heartbeat timeout of 2 s (the import a
plugin's ``preload`` may name, such as torch's on a slow file system; tests/test_plugins.py)."""

import os
import time

time.sleep(5)  # the slow import itself
PID = os.getpid()
