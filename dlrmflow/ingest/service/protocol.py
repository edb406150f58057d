"""What travels between a reader server and its clients: addresses, tickets, marked errors.

The ticket (JSON, ``StreamRequest``) names the rank, world size, reader ``w`` of
``num_workers``, epoch, seed, batch size and shuffle settings, the files (relative to the
dataset root, which each server resolves under its own), a digest of the client's features
(a server whose own digest differs refuses), and the ``SplitReader`` state to start from.
Each record batch carries the reader's state after it as Flight metadata, so the client
always knows the exact position of the next row. Flight's streaming is the back-pressure: a
server reads ahead a few windows and what gRPC buffers, never an epoch.

Bad data (``DataError``) and a refused request (``ValueError``: mismatched features, a state
of another layout) are not failures of the endpoint: the server sends them marked
(``marked_errors``), and the client raises them as those types (``read_marked``) instead of
failing over, since every endpoint would answer the same. Both sides read this one module,
so what one sends the other reads.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pyarrow.flight as flight
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dlrmflow.ingest.errors import DataError

STATE_ACTION = "reader-state"
# The row groups a ticket's files hold, as the server lists them: the trainer counts a pass's
# steps from them exactly as local readers would cut it (``reader.pass_steps``).
SPLITS_ACTION = "reader-splits"
# Stands for the Flight errors a server sends on purpose: the client raises them as these
# types instead of failing over, since another endpoint would refuse the same request.
_MARKED = {"DataError": DataError, "ValueError": ValueError}


@dataclass(frozen=True)
class Endpoint:
    """A reader server's ``HOST:PORT`` (``[v6addr]:PORT`` for IPv6); ``tls``: reached over
    ``grpc+tls``."""

    host: str
    port: int
    tls: bool = False

    @classmethod
    def parse(cls, text: str, *, tls: bool = False) -> Endpoint:
        host, sep, port = text.strip().rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"reader endpoint {text!r}: expected HOST:PORT, e.g. 10.0.0.5:8815")
        return cls(host, int(port), tls)

    @property
    def location(self) -> str:
        scheme = "grpc+tls" if self.tls else "grpc"
        return f"{scheme}://{self}"

    @property
    def loopback(self) -> bool:
        """Whether only this host can reach the address (a name other than localhost is
        taken as reachable from outside: what it resolves to may change)."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


class StreamRequest(BaseModel):
    """A Flight ticket: one reader's batches of one rank, from ``state`` (or the epoch start)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    files: tuple[str, ...] = Field(min_length=1, description="relative to the dataset root")
    features: str = Field(description="digest of the client's features, the server's to match")
    batch_size: int = Field(ge=1)
    seed: int = Field(ge=0)
    shuffle: bool
    shuffle_window: int = Field(ge=1)
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    worker: int = Field(ge=0)
    num_workers: int = Field(ge=1)
    epoch: int = Field(ge=0)
    state: dict[str, Any] | None = None

    def encode(self) -> bytes:
        return self.model_dump_json().encode()


def refuse(kind: str, message: str) -> flight.FlightServerError:
    """A Flight error that marks ``message`` as a ``kind`` (a ``_MARKED`` name): the client
    raises it as that type (``read_marked``) instead of failing over."""
    return flight.FlightServerError(
        message, extra_info=json.dumps({"type": kind, "message": message}).encode()
    )


@contextmanager
def marked_errors() -> Iterator[None]:
    """Send bad data and bad requests as marked errors, so that clients do not fail over."""
    try:
        yield
    except DataError as e:
        raise refuse("DataError", str(e)) from e
    except ValidationError as e:
        raise refuse("ValueError", f"bad request: {e}") from e
    except (ValueError, KeyError) as e:
        raise refuse("ValueError", str(e)) from e


def read_marked(error: Exception) -> tuple[type[Exception], str] | None:
    """The type and message of an error the server sent on purpose, else None."""
    if not isinstance(error, flight.FlightServerError) or not error.extra_info:
        return None
    try:
        info = json.loads(error.extra_info)
        return _MARKED[info["type"]], info["message"]
    except (ValueError, KeyError, TypeError):
        return None
