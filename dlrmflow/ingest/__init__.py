"""Ingest stage: datasets and the reading of them, split across ranks.

A dataset is made by ``register`` (day-partitioned Parquet registered where it lies, under
a declared schema; ``registered_days`` the days that land under it later, ``infer`` a
first schema guessed from it), ``criteo`` (Criteo's TSV days converted) or ``synthetic``
and ``synthetic_logs`` (generated with a known click model, grown a day at a time by
``generated``); ``dayfile``, ``manifest``, ``lock``, ``schema`` (Criteo's layout) and
``strings`` (string IDs hashed to int64) serve them, and ``stats`` computes the feature
statistics. Reading a dataset as Arrow record batches split by rank and worker,
resumable: ``splits`` (row groups dealt to readers each epoch), ``decode`` (a split
decoded and validated, its file held to its identity), ``reader`` (one reader's pass, with
``window`` and ``shuffle`` building its shuffled windows), ``loader`` (readers behind
prefetch threads: ``make_loader``) and ``errors`` (``DataError``, raised across the
stage); ``service`` is the reader service that streams those batches to trainers on
other hosts.
"""
