"""How a raw row becomes a servable program's inputs: the ``raw_inputs`` record of a
``dlrmflow export --format torch-export`` archive.

A serving system that runs the exported program without dlrmflow still has to build its
inputs from raw rows exactly as training did, or the program scores other features than
the model learned. So the archive says, for each feature in the program's input order,
which column(s) it reads and every operation on the way: fills and transforms of dense
columns (standardize's frozen mean and deviation included), string IDs to int64, the
hash (its salt and formula) or the vocabulary that maps an ID to its row, list cuts
(``max_length``, ``keep``), per-ID weights, crosses' hashing and buckets' boundaries.
Each formula is written out with its constants once; each feature names the ones it
uses. ``tests/train/run/test_exported_model_raw.py`` implements the record in plain numpy and
gets dlrmflow's inputs and scores, so the record and the code cannot drift apart.

The formulas mirror ``dlrmflow.features`` (``transform``, ``ids``) and
``dlrmflow.ingest.strings``; what is said here is what those modules do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dlrmflow.config import RunConfig
from dlrmflow.features.ids import feature_salt
from dlrmflow.features.spec import FeatureSpec, SparseFeature
from dlrmflow.schema import DenseFeature

__all__ = ["INPUTS", "WEIGHTS_INPUT", "program_inputs", "raw_recipe"]

# The program's inputs as the archive's ``inputs`` describes them (a model without per-ID
# weights: these, as every export before weights had them).
INPUTS = {
    "dense": "float32 [B, n_dense]: the transformed dense features, as Batch.dense",
    "values": "int64 [N]: embedding rows, key-major (all samples' IDs of feature 0, then 1, ...)",
    "offsets": "int64 [T*B+1]: bag k*B+i (feature k, sample i) is values[offsets[k*B+i]:"
    "offsets[k*B+i+1]]; an empty bag is a missing ID",
    "output": "float32 [B]: click probabilities",
    "dynamic": "B >= 1 and N >= 0",
}
WEIGHTS_INPUT = (
    "float32 [N]: the weight of each ID of values, in values' order: the feature's per-ID "
    "weight for features with weights ({features}), 1.0 for every other feature's IDs; it "
    "scales the ID's embedding in its bag's sum"
)

STRING_IDS = (
    "a string ID becomes int64: FNV-1a 64 over its UTF-8 bytes (h = 0xCBF29CE484222325; "
    "for each byte: h ^= byte; h *= 0x100000001B3), then z ^= z >> 30; "
    "z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31 "
    "(uint64, wrapping)"
)
MIX = (
    "h(z): z ^= z >> 32; z *= 0xBF58476D1CE4E5B9; z ^= z >> 32; z *= 0x94D049BB133111EB "
    "(uint64, wrapping)"
)
HASH_ROW = (
    "((h(x + salt) >> 32) * rows) >> 32 in uint64 arithmetic, x the ID's 64-bit pattern "
    "(two's complement), h as under 'hash'"
)
SALT = (
    "each hashed feature's salt (given): int.from_bytes(hashlib.blake2b(f'{seed}:{name}'"
    ".encode(), digest_size=8).digest(), 'little') with seed 0 and the name of the "
    "feature's table (its 'table' where it shares one, else the feature's own name)"
)
VOCAB = (
    "row = 1 + the position of the ID (its 64-bit pattern; a string ID after string_ids) "
    "in the feature's vocabulary, 0 for an ID not in it; the vocabulary file is a numpy "
    ".npz: json.loads(str(npz['meta']))['names'] lists its features, and npz[f'ids_{K}'] "
    "holds the IDs of names[K]"
)
BAGS = (
    "each feature's bag in a row: its column's ID (a one-hot column; none when null), or "
    "its list's IDs in list order (a list column; none for a null list), a null inside a "
    "list dropped; then, with max_length, only the first (keep: first) or last (keep: "
    "last) max_length of them; each ID then becomes its row ('ids')"
)
WEIGHTS = (
    "a feature with 'weights' reads that column beside its IDs: a list aligned with the ID "
    "list (a one-hot ID: one number); each ID kept takes the weight at its own position, "
    "as float32 (so a null ID's weight and a cut ID's weight go with it); every ID of a "
    "feature without weights weighs 1.0"
)
CROSS = (
    "a cross reads one ID a row of each of its columns (strings by string_ids), c_0, c_1, "
    "...: x = H(c_0), then x = H(c_i + x) for each next column (uint64, wrapping), where "
    "H(z) is h(z) followed by z ^= z >> 32; x is then hashed to a row as any ID, with the "
    "cross's own salt; a row where any crossed column is null has an empty bag"
)
BUCKETIZE = (
    "a bucketized column: v = its value as float32, fill where null or NaN; the row is the "
    "count of boundaries b with float32(b) <= v (numpy.searchsorted(float32 boundaries, v, "
    "'right')); every sample has a bag of one"
)
DENSE = (
    "each value as float32, null and NaN as fill, then log: log1p(max(x, 0)); clip: "
    "min(max(x, clip_min), clip_max); standardize: (x - mean) / std (std 0 taken as 1); "
    "none: x; every step in float32 with float32 constants"
)


def program_inputs(spec: FeatureSpec) -> dict[str, str]:
    """The archive's description of the program's inputs: ``INPUTS``, with ``weights``
    after ``offsets`` when ``spec`` has features with per-ID weights."""
    weighted = [f.name for f in spec.sparse if f.weights is not None]
    if not weighted:
        return dict(INPUTS)
    described = {}
    for name, text in INPUTS.items():
        described[name] = text
        if name == "offsets":
            described["weights"] = WEIGHTS_INPUT.format(features=", ".join(weighted))
    described["dynamic"] = "B >= 1 and N >= 0; weights has N entries, as values"
    return described


def _sparse(feature: SparseFeature, default_ids: str) -> dict[str, Any]:
    """One feature's entry: the columns it reads and each of its operations."""
    mapping = feature.mapping(default_ids)
    entry: dict[str, Any] = {"name": feature.name}
    if feature.bucketize is not None:
        entry["column"] = feature.bucketize.column
        entry["fill"] = feature.bucketize.fill
        entry["boundaries"] = list(feature.bucketize.boundaries or ())
    elif feature.cross is not None:
        entry["cross"] = list(feature.cross)
    else:
        entry["column"] = feature.name
    entry["ids"] = mapping
    entry["rows"] = feature.num_embeddings
    if feature.table is not None:
        entry["table"] = feature.table  # shared: its rows are the table's, as its salt
    if mapping == "hash":
        entry["salt"] = feature_salt(feature.table_name)
    if feature.max_length is not None:
        entry["max_length"] = feature.max_length
        entry["keep"] = feature.keep
    if feature.weights is not None:
        entry["weights"] = feature.weights
    entry["pooling"] = feature.pooling
    return entry


def raw_recipe(spec: FeatureSpec, config: RunConfig, run_dir: Path | None = None) -> dict[str, Any]:
    """The ``raw_inputs`` record of ``spec``'s program (see the module's docstring).

    ``dense``: each dense input's column, fill and transform, in ``dense``'s order;
    ``sparse``: each feature, in ``values``' key order, with the columns it reads and how
    its IDs become rows (``ids``: ``hash`` with its ``salt``, ``vocab``, or ``bucket``);
    then the formulas those name, only the ones some feature uses. ``run_dir`` is where a
    vocabulary's file lies (the run's ``vocab.npz``).
    """
    from dlrmflow.train.run.data import VOCAB_FILE

    dense = spec.dense_transforms or tuple(DenseFeature(column=c) for c in spec.dense)
    default_ids = config.features.ids
    sparse = [_sparse(f, default_ids) for f in spec.sparse]
    mappings = {entry["ids"] for entry in sparse}
    recipe: dict[str, Any] = {
        "label": spec.label,
        # The program's positional inputs, in order.
        "inputs": [n for n in program_inputs(spec) if n not in ("output", "dynamic")],
        "dense": [d.record() for d in dense],
        "sparse": sparse,
    }
    if spec.weight is not None:
        recipe["weight"] = spec.weight
        recipe["not_inputs"] = (
            f"the label ({spec.label}) and the example weight ({spec.weight}) train the "
            "model only; the program reads neither"
        )
    recipe["dense_transforms"] = DENSE
    recipe["bags"] = BAGS
    recipe["string_ids"] = STRING_IDS
    recipe["ids"] = (
        "hash: the row by 'row' with the feature's salt; vocab: the row by 'vocab'; "
        "bucket: the row by 'bucketize'"
    )
    if "dynamic" in mappings:
        recipe["dynamic"] = (
            "the raw int64 ID itself (a string hashed by 'string_ids'): the program maps it "
            "by the map it carries, frozen at export; an ID without a row reads row 0"
        )
    if "hash" in mappings:
        recipe["hash"] = MIX
        recipe["row"] = HASH_ROW
        recipe["salt"] = SALT
    if "vocab" in mappings:
        where = str(run_dir / VOCAB_FILE) if run_dir is not None else VOCAB_FILE
        recipe["vocab"] = {"file": where, "lookup": VOCAB}
    if any(f.cross is not None for f in spec.sparse):
        recipe["cross"] = CROSS
    if "bucket" in mappings:
        recipe["bucketize"] = BUCKETIZE
    if any(f.weights is not None for f in spec.sparse):
        recipe["weights"] = WEIGHTS
    return recipe
