"""Benchmarks: each prints JSON whose ``ratios`` are ours / a baseline measured in the same run.

One module per benchmark, each a ``dlrmflow bench`` command: ``kernels`` (a TBE step and
the interaction against plain torch), ``step`` (a training step against the machine's
ceiling), ``precision`` (bf16 against fp32), ``train`` (the sharded trainer per sharding
type and codec), ``torchrec_compare`` (against TorchRec's DLRM), ``scale`` (tables beyond
a rank's memory), ``ingest`` (the reader and transform against pyarrow's decode),
``ingest_days`` (the ingest flow's days on a Dask cluster), ``readers`` (reader servers
feeding a starved trainer), ``recurring`` (a model line against retraining and a frozen
model), ``movielens`` (a line on real data), ``schedule`` (the learning-rate sweep behind
the defaults). ``report`` runs them all and ``docs`` writes ``docs/benchmarks.md`` from
its JSON. What they share: ``turns`` (cases timed in turns, best of N), ``machine`` (the
machine's description and each process's share of its cores), ``spawn`` (gloo jobs of
spawned processes).

Only the ``bench`` command imports them; a benchmark may run a flow it measures
(``tests/test_layout.py``).
"""
