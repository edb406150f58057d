"""``Batch`` <-> Arrow record batch, for the reader service, and what decides a batch's tensors.

Reader servers (``dlrmflow.ingest.service``) stream record batches; these are the codec
their batches travel in and the digest a server and a trainer compare to know that the
same features would give the same tensors.

Wire format. dense: fixed_size_list<float32>[n_dense]; labels: float32; "sample_weights":
float32, only where the batch carries them (a dataset with a weight column); the sparse IDs
either one-hot, "sparse_rows": fixed_size_list<int32|int64>[n_keys] (-1: empty bag), as
compact as the transform's own form, or jagged, one list<int64> column "sparse.KEY" per
key, and, where the IDs carry per-ID weights, one list<float32> column "weights.KEY" per key
beside it. The keys, in order, are in the schema metadata.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from dlrmflow.features.batch import Batch
from dlrmflow.features.ids import FeatureIds, HashIds, Vocabulary
from dlrmflow.features.spec import FeatureSpec
from dlrmflow.sparse import KeyedJaggedTensor


def features_digest(spec: FeatureSpec, ids: HashIds | Vocabulary | FeatureIds) -> str:
    """What decides the tensors of a batch: column names, dense transforms, table sizes, the
    weight column, how each feature's IDs are made and the ID mapping.

    Embedding widths and pooling are left out: they shape the model, not the batches, so
    reader servers need no model config.
    """
    h = hashlib.sha256()
    h.update(json.dumps([spec.label, list(spec.dense)]).encode())
    if spec.dense_transforms is not None:  # Criteo's transforms leave the digest as it was
        transforms = [t.record() for t in spec.dense_transforms]
        h.update(json.dumps(transforms, sort_keys=True).encode())
    h.update(json.dumps([[f.name, f.num_embeddings] for f in spec.sparse]).encode())
    if spec.weight is not None:  # no weight column leaves the digest as it was
        h.update(json.dumps({"weight": spec.weight}).encode())
    # The sources of features beyond a plain column (lists cut, weights, crosses, buckets);
    # a spec without them leaves the digest as it was.
    sources = {}
    for f in spec.sparse:
        source = {k: v for k, v in f.to_dict().items() if k not in _MODEL_FIELDS}
        if source:
            sources[f.name] = source
    if sources:
        h.update(json.dumps(sources, sort_keys=True).encode())
    mappers = (ids.vocabulary, ids.hashed) if isinstance(ids, FeatureIds) else (ids,)
    for mapper in mappers:
        _digest_mapper(h, mapper)
    return h.hexdigest()


# What a sparse feature's ``to_dict`` holds beyond how its IDs are made.
_MODEL_FIELDS = ("name", "num_embeddings", "embedding_dim", "pooling", "ids", "min_count")


def _digest_mapper(h: Any, ids: HashIds | Vocabulary) -> None:
    if isinstance(ids, Vocabulary):
        for name in sorted(ids.ids):
            h.update(name.encode())
            h.update(ids.ids[name].tobytes())
    else:
        h.update(json.dumps(["hash", ids.seed, sorted(ids.table_rows.items())]).encode())


def _batch_schema(batch: Batch) -> pa.Schema:
    sparse = batch.sparse
    fields = [
        pa.field("dense", pa.list_(pa.float32(), batch.dense.shape[1]), nullable=False),
        pa.field("labels", pa.float32(), nullable=False),
    ]
    if batch.sample_weights is not None:
        fields.append(pa.field("sample_weights", pa.float32(), nullable=False))
    rows = sparse.one_hot_rows
    if rows is not None:
        item = pa.from_numpy_dtype(rows.numpy().dtype)
        fields.append(pa.field("sparse_rows", pa.list_(item, len(sparse.keys)), nullable=False))
    else:
        fields += [
            pa.field(f"sparse.{k}", pa.list_(pa.int64()), nullable=False) for k in sparse.keys
        ]
        if sparse.weights is not None:
            fields += [
                pa.field(f"weights.{k}", pa.list_(pa.float32()), nullable=False)
                for k in sparse.keys
            ]
    return pa.schema(fields, metadata={"keys": json.dumps(sparse.keys)})


def encode_batch(batch: Batch) -> pa.RecordBatch:
    """``batch`` as one record batch; batches of one stream share its schema."""
    sparse = batch.sparse
    n = len(batch)
    dense = pa.FixedSizeListArray.from_arrays(
        pa.array(batch.dense.contiguous().numpy().reshape(-1)), batch.dense.shape[1]
    )
    columns = [dense, pa.array(batch.labels.numpy())]
    if batch.sample_weights is not None:
        columns.append(pa.array(batch.sample_weights.contiguous().numpy()))
    rows = sparse.one_hot_rows
    if rows is not None:
        flat = rows.contiguous().numpy().reshape(-1)
        columns.append(pa.FixedSizeListArray.from_arrays(pa.array(flat), len(sparse.keys)))
    else:
        # Key k's bags are lengths[k*n:(k+1)*n]; their offsets into the key-major values,
        # shifted to start at 0, cut that key's slice of the values.
        offsets, values = sparse.offsets().numpy(), sparse.values.numpy()
        weights = None if sparse.weights is None else sparse.weights.numpy()
        cuts = []
        for k in range(len(sparse.keys)):
            key_offsets = offsets[k * n : (k + 1) * n + 1]
            first, last = int(key_offsets[0]), int(key_offsets[-1])
            cuts.append((pa.array((key_offsets - first).astype(np.int32)), first, last))
        for flat in (values, weights):
            if flat is not None:
                columns += [
                    pa.ListArray.from_arrays(starts, pa.array(flat[first:last]))
                    for starts, first, last in cuts
                ]
    return pa.RecordBatch.from_arrays(columns, schema=_batch_schema(batch))


def _rows(column: pa.FixedSizeListArray) -> np.ndarray:
    """The [len, list_size] values of a fixed-size list column, copied.

    A copy, so that the tensors own writable memory rather than pin the gRPC message;
    ``values`` sliced by hand, since ``flatten()`` is a compute call that costs more here.
    """
    size = column.type.list_size
    values = column.values.slice(column.offset * size, len(column) * size)
    return values.to_numpy().reshape(len(column), size).copy()


def decode_batch(data: pa.RecordBatch) -> Batch:
    """The ``Batch`` that ``encode_batch`` encoded."""
    keys = json.loads(data.schema.metadata[b"keys"])
    dense = _rows(data.column("dense"))
    labels = data.column("labels").to_numpy().copy()
    sample_weights = None
    if "sample_weights" in data.schema.names:
        sample_weights = torch.from_numpy(data.column("sample_weights").to_numpy().copy())
    if "sparse_rows" in data.schema.names:
        sparse = KeyedJaggedTensor.from_one_hot(
            keys, torch.from_numpy(_rows(data.column("sparse_rows")))
        )
    else:
        columns = [data.column(f"sparse.{key}") for key in keys]
        values = np.concatenate([c.flatten().to_numpy() for c in columns])
        lengths = np.concatenate([np.diff(c.offsets.to_numpy()) for c in columns])
        weights = None
        if keys and f"weights.{keys[0]}" in data.schema.names:
            weighted = [data.column(f"weights.{key}").flatten().to_numpy() for key in keys]
            weights = torch.from_numpy(np.concatenate(weighted))
        sparse = KeyedJaggedTensor(
            keys, torch.from_numpy(values), torch.from_numpy(lengths.astype(np.int32)), weights
        )
    return Batch(torch.from_numpy(dense), sparse, torch.from_numpy(labels), sample_weights)
