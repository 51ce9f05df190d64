"""The toolkit's version (part of every persistent cache key)."""

__version__ = "0.1.0"
