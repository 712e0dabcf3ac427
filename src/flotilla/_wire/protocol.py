"""What the client, the providers and the node side agree on beyond the frames
(``frames.py``): timings and the names of environment variables and stream markers.

Standard library only: the agent imports it at start-up.
"""

from __future__ import annotations

BUILD_STOP_GRACE = 5.0
"""Seconds a stopped environment build gets to remove its half-built folder."""

CLOUD_ENV = "FLOTILLA_CLOUD"
"""Set by a cloud provider in the agent's environment (JSON, ``_node/cloud.py``'s
``Config``): the agent starts the instance watchdog and the interruption poller."""
CLOUD_NOTICE = b"FLOTILLA_CLOUD NOTICE "
"""Prefix of the agent's stderr line that announces a spot interruption."""
