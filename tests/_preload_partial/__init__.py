"""A package a test plugin names in its ``preload`` (tests/test_plugins.py) whose import fails
in the agent's preload and works in an executor, after one of its submodules was imported
whole: as a preload of ``torch._dynamo`` that failed once left submodules behind."""

from . import done, fails_in_the_agent  # noqa: F401
