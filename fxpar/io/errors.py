"""The error a data source raises (fxpar.io.data, fxpar.io.volumes)."""


class DataError(ValueError):
    """A dataset that cannot be used as given; the message names the file and what to do."""
