"""Stand-in: MaxText names Manager in an annotation."""


class Manager:
    """Never instantiated by the tested paths."""
