"""Prefect defaults for running with no set-up: local ephemeral API, offline, quiet.

Each value is only a default: a user's own environment (for example ``PREFECT_API_URL``
pointing at a team's Prefect server) always wins.
"""

from __future__ import annotations

import os

PREFECT_DEFAULTS = {
    # No telemetry: these machines are often offline and users did not ask for it.
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # Quiet console while run logs still reach the API (PREFECT_LOGGING_LEVEL would drop them):
    # a failed task or flow is logged there with its traceback, and the command says why in
    # one line (DLRMFLOW_DEBUG=1 shows Prefect's warnings and tracebacks on the console too).
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING"
    if os.environ.get("DLRMFLOW_DEBUG")
    else "CRITICAL",
    # The ephemeral API's first start runs migrations; 20 s is too short on a busy 2-core box.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
}


def configure_prefect_env() -> None:
    """Set the defaults above for every variable the user has not set. Call before importing
    prefect."""
    for key, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(key, value)
