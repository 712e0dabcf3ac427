"""Imported whole before its sibling fails: records the package object it was imported in."""

import sys

PACKAGE = sys.modules[__name__.rpartition(".")[0]]
