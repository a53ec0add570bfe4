"""Stand-in: MaxText imports SentencePieceProcessor; the tested paths never call it."""


class SentencePieceProcessor:
    """Never instantiated by the tested paths."""
