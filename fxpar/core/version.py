"""The fxpar version (pyproject reads it from here; saved programs record it)."""

__version__ = "0.1.0"
