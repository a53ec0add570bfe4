"""Stand-in: MaxText imports transformers; the tested paths never call it."""
