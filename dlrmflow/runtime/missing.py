"""The one-line error of a private piece that is gone and has no public path around it.

Most pieces here fall back to a public path when the library has moved them; a few carry
something nothing public can (a checkpoint resharded on load, a check inside an exported
program). Where such a piece is gone, the command stops in one line naming the piece, the
installed version and the version dlrmflow was checked against, rather than failing deep
inside the library or silently doing less.
"""

from __future__ import annotations

from dlrmflow.errors import DlrmflowError


class MissingPiece(DlrmflowError):
    """``piece`` is not in the installed ``installed`` (e.g. "torch 2.14.0"); dlrmflow was
    checked against ``checked`` and needs it for ``needed_for``."""

    def __init__(self, piece: str, installed: str, checked: str, needed_for: str) -> None:
        super().__init__(
            f"{piece} is missing from {installed} (dlrmflow was checked against {checked}), "
            f"and {needed_for} has no other way: install the versions of constraints.txt"
        )
        self.piece = piece
