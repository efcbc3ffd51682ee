"""The error of a recorded series that cannot be backtested as given.

Its own module, apart from the readers that raise it: the CLI catches it in every command, and
the readers bring polars, which no other command needs to load."""


class BacktestError(ValueError):
    """A file that cannot be backtested as given; one line, naming the file, or the column and row."""
