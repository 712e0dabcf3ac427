"""Providers: where nodes come from (local processes, SSH hosts, ...), behind one interface."""
