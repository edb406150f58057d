"""Prefect's "your flows are being served" message, which only its private helper prints.

``dlrmflow serve`` runs its own subclass of Prefect's ``Runner`` (so that a stopping
signal ends it in order) instead of ``prefect.serve``, which prints the served
deployments and how to trigger them before it starts its runner. What it reaches into,
written against Prefect 3.9.1: ``prefect.flows._display_serve_start_message(*deployments)``.
Nothing is gained in speed; a user sees the message ``prefect.serve`` shows.

Fallback, where the helper has moved: one line naming the deployments, on stderr.
``tests/runtime/test_prefect_serve.py`` runs both and fails when the installed Prefect no
longer has the helper.
"""

from __future__ import annotations

import sys
from typing import Any


def display_serve_start_message(deployments: list[Any]) -> bool:
    """Print what ``prefect.serve`` prints as it starts serving ``deployments``; True when
    Prefect's own message was printed, False for the fallback line."""
    from prefect import flows

    display = getattr(flows, "_display_serve_start_message", None)
    if callable(display):
        display(*deployments)
        return True
    names = ", ".join(getattr(d, "name", str(d)) for d in deployments)
    print(f"serving deployments: {names}", file=sys.stderr)
    return False
