"""Agents on EC2 instances: interruption notices.

An instance is an SSH host whose host key the client generated (``cloud.keys``): the
agent starts through ``ssh`` as on any cloud instance (``cloud.allocation``, the client's
exact flotilla shipped by content hash), with the pool's login key and known_hosts, once
the instance answers on port 22; spot interruption notices come on its stderr, taken out
by the cloud kit's ``NoticeAgent`` (``cloud/notice.py``).
"""

from __future__ import annotations

from ..cloud.notice import NoticeAgent as AWSAgent

__all__ = ["AWSAgent"]
