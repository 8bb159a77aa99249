"""The error a data source raises (fxpar.data.data, fxpar.data.volumes)."""


class DataError(ValueError):
    """A dataset that cannot be used as given; the message names the file and what to do."""
