"""The AWS provider: EC2 instances for a pool (see ``provider`` for the design)."""

from .provider import AWS

__all__ = ["AWS"]
