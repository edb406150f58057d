"""A day file's digest recomputed from its bytes, to check what the writer recorded.

The writer hashes every byte before the footer as it writes them and stores the digest in
the footer (``dlrmflow.ingest.dayfile.DIGEST_KEY``); the manifest records it. The tests
recompute it here from the file on disk, independently of the writer's streaming hash.
"""

from __future__ import annotations

import hashlib
import os


def content_digest(path: str | os.PathLike[str]) -> str:
    """SHA-256 of the local Parquet file ``path``'s bytes before its footer."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(size - 8)
        footer = int.from_bytes(f.read(4), "little") + 8
        f.seek(0)
        return hashlib.sha256(f.read(size - footer)).hexdigest()
