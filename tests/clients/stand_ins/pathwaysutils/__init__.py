"""Stand-in: MaxText imports pathwaysutils; the tested paths never call it."""
