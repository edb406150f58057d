"""The base of every expected failure: bad data, bad configuration, a busy run directory.

Commands print an expected failure as one line (``error: <message>``) and exit 1; the
traceback shows only with ``DLRMFLOW_DEBUG=1``. Stages raise a subclass whose message names
what to fix (the key, file, row group, column, step or rank), so the line alone is enough.
"""

from __future__ import annotations


class DlrmflowError(Exception):
    """An expected failure whose message names its cause; shown as one line, exit
    ``exit_code`` (1; a command stopped by a signal exits as the shell would, 128 + it)."""

    exit_code: int = 1
