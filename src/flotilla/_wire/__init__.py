"""The wire format shared by client and node: frames, the typed bodies of HELLO, CONFIG and
READY, the protocol's constants, serialization, exit descriptions.

Standard library only: the node side imports it.
"""
