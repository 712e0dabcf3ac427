"""The wire format shared by client and node: frames, serialization, exit descriptions.

Standard library only: the node side imports it.
"""
