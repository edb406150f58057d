"""Raw Criteo TSV days -> Parquet day partitions with the shared Criteo schema.

A raw Criteo day is one tab-separated line per impression: label, 13 integer counts and 26
hexadecimal category IDs, no header, an empty field meaning "missing". Each input file
becomes one day (``OUT/day=K/part-<name>.parquet``, the generator's layout, the name a hash
of the input's fingerprint and the options: ``day_file_name``), so everything downstream
runs unchanged on real data.

The conversion in pieces, one job each:

- ``tsv``: raw bytes -> Arrow columns, in blocks of whole lines, each malformed line found
  with its number and reason (the parsing, which knows nothing of files or days);
- ``convert``: input files -> day files and the dataset's manifest (``convert_criteo``, and
  the three steps the ingest flow runs apart), with each input's quarantine of bad lines;
- ``landing``: a landing folder that gains a raw file a day -> the dataset grown by only
  the new days (``convert_landed``).

This package's ``__init__`` holds no name: each is imported from the module it lives in.
"""
