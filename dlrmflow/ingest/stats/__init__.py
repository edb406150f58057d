"""Feature statistics of a Parquet dataset, in one streaming pass over its row groups.

Sizing embedding tables (hash buckets, vocabulary caps), choosing dense transforms and
spotting a broken upstream export all start from the same facts: how often each column is
missing, the range of the counts, how many distinct IDs each categorical feature has, how
long multi-hot lists are and how skewed their accesses are. The statistics in pieces, one
job each:

- ``scan``: the pass over a dataset's day files (``dataset_stats``; ``file_stats`` and
  ``merge_stats``, the steps the ingest flow runs one day at a time), with each column's
  running totals;
- ``sketches``: the bounded summaries those totals keep, each merging exactly in any order
  (distinct IDs, access skew, dense values' quantiles, exact sums of squares);
- ``cache_hits``: the hit rates of an LRU cache of hot rows, from access counts;
- ``results``: what the pass results in (``DatasetStats``) and its file, ``stats.json``.

Each name is imported from the module it lives in.
"""

from __future__ import annotations
