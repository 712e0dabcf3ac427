"""The node side: the agent every provider starts, its executor and environment builder.

Standard library only: nodes may have nothing but Python.
"""
