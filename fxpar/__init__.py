"""fxpar."""
