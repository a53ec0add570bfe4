"""Stand-in module."""
