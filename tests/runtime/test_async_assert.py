"""The check inside an exported program (``runtime.async_assert``): ``torch.export`` keeps
it, the program raises on inputs that fail it, and where torch no longer has the operator
an export stops in one line rather than leaving the check out."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dlrmflow.runtime.async_assert import assert_async
from dlrmflow.runtime.missing import MissingPiece

MESSAGE = "ids must lie in the table"


class Lookup(nn.Module):
    """A table lookup that checks its IDs first, as the servable export does."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(4, dtype=torch.float32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        assert_async(((ids >= 0) & (ids < self.table.shape[0])).all(), MESSAGE)
        return self.table[ids.clamp(0, self.table.shape[0] - 1)]


def _exported() -> nn.Module:
    n = torch.export.Dim("n", min=2)
    ids = torch.tensor([0, 3])
    return torch.export.export(Lookup(), (ids,), dynamic_shapes=({0: n},)).module()


def test_an_exported_program_keeps_the_check_and_raises_on_bad_inputs():
    # Fails when the installed torch no longer has torch._assert_async (MissingPiece), or
    # when the exporter drops the check from the program.
    program = _exported()
    assert torch.equal(program(torch.tensor([1, 2, 3])), torch.tensor([1.0, 2.0, 3.0]))
    for bad in (torch.tensor([0, 4]), torch.tensor([-1, 0, 1])):
        with pytest.raises(RuntimeError, match=MESSAGE):
            program(bad)


def test_eagerly_the_check_raises_with_its_message():
    assert_async(torch.tensor(True), MESSAGE)
    with pytest.raises(RuntimeError, match=MESSAGE):
        assert_async(torch.tensor(False), MESSAGE)


def test_without_the_operator_an_export_stops_in_one_line(monkeypatch):
    monkeypatch.delattr(torch, "_assert_async")
    with pytest.raises(MissingPiece) as error:
        _exported()
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"torch._assert_async is missing from torch {torch.__version__} ")
    assert "servable export" in message
