"""Command-line backends: one module per provider kind."""
