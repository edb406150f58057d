"""The ingest stage's expected failure: input data that cannot be used.

Raised by every part of the stage that looks at data (listing splits, decoding row groups,
registering days, manifests, statistics, conversion) with a message that names the file,
row group and column, so that the command prints one line and exits 1.
"""

from __future__ import annotations

from dlrmflow.errors import DlrmflowError


class DataError(DlrmflowError, ValueError):
    """Input data that cannot be used; the message names the file, row group and column."""
