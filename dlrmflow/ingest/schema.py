"""The Criteo-layout schema shared by the synthetic generator and the raw Criteo converter.

One schema for both sources means everything downstream (reader, features, trainer) is
tested on synthetic data and runs unchanged on real Criteo days.
"""

from __future__ import annotations

import pyarrow as pa

LABEL = "label"
DENSE = tuple(f"I{i}" for i in range(1, 14))
SPARSE = tuple(f"C{i}" for i in range(1, 27))

# Distinct values per categorical column in the Criteo Kaggle display-advertising data
# (7 days). The synthetic generator scales these down so that tests stay tiny while the
# shape (a few huge tables, many small ones) stays Criteo's.
CRITEO_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip


def criteo_schema(multi_hot: bool = False) -> pa.Schema:
    """Arrow schema of a day file: int8 label, nullable int32 counts, nullable int64 IDs.

    With ``multi_hot`` each categorical column is a list of IDs (variable length, possibly
    empty) instead of a single nullable ID.
    """
    id_type = pa.list_(pa.int64()) if multi_hot else pa.int64()
    fields = [pa.field(LABEL, pa.int8(), nullable=False)]
    fields += [pa.field(name, pa.int32()) for name in DENSE]
    fields += [pa.field(name, id_type) for name in SPARSE]
    return pa.schema(fields)


def schema_to_json(schema: pa.Schema) -> list[dict[str, str]]:
    """The schema as a list of ``{"name", "type"}`` records for manifest.json."""
    return [{"name": f.name, "type": str(f.type)} for f in schema]
