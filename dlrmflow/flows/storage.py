"""Where the flows' cached task results live: one location every worker shares.

Prefect keeps a persisted task result, and the cache record that lets a later run skip the
task, in its result storage; by default that is ``$PREFECT_HOME/storage`` on whichever host
ran the task, so hosts in a work pool (or Dask workers on other machines) would never reuse
each other's ingest. The flows instead put them at ``orchestration.result_storage``, a path
or fsspec URL every worker can reach, by default ``_prefect_results`` beside the dataset
(``<data.url>/_prefect_results``: Parquet readers skip names starting with ``_``).

Each record is one file named by the task's cache key, holding the result and its metadata
together (Prefect's layout when the cache policy has no separate ``key_storage``), so the
cache keys live in the shared location too. A separate key storage is not used: Prefect
would write each result at its absolute local path and record that path in the key's
metadata, which breaks as soon as two hosts mount the share at different paths.

Results are serialized as JSON (the cached tasks return plain records), readable by any
host and any Python, and open to inspection.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import fsspec

from dlrmflow.config import RunConfig
from dlrmflow.ingest.manifest import join_url

RESULTS_DIR = "_prefect_results"
RESULT_SERIALIZER = "json"


def result_location(config: RunConfig) -> str:
    """The run's result location: ``orchestration.result_storage`` or the default beside
    the dataset."""
    return config.orchestration.result_storage or join_url(config.data.url, RESULTS_DIR)


def result_storage(location: str) -> Any:
    """What Prefect takes as a task's ``result_storage`` for ``location``.

    A local path (or ``file://`` URL) is passed as a ``Path`` (Prefect makes it a
    ``LocalFileSystem``, relative paths resolved against each worker's working directory).
    Any other fsspec URL becomes a ``RemoteFileSystem`` block, saved on the Prefect server
    (Prefect takes only saved blocks) under a name derived from the URL; credentials come
    from the environment as fsspec finds them.
    """
    protocol, path = fsspec.core.split_protocol(location)
    if protocol in (None, "file", "local"):
        return Path(path).expanduser()
    from prefect.filesystems import RemoteFileSystem

    block = RemoteFileSystem(basepath=location.rstrip("/"))
    digest = hashlib.sha256(location.encode()).hexdigest()[:16]
    block.save(f"dlrmflow-results-{digest}", overwrite=True, _sync=True)
    return block


def shared_results(config: RunConfig) -> dict[str, Any]:
    """Task options (for ``task.with_options``) that persist a cached task's results and
    cache records as JSON at the run's result location."""
    return {
        "persist_result": True,
        "result_storage": result_storage(result_location(config)),
        "result_serializer": RESULT_SERIALIZER,
    }
