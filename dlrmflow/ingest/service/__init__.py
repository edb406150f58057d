"""The reader service: reader servers stream a dataset's batches to trainers over Arrow Flight.

Preprocessing can outgrow the CPUs beside an accelerator; reader servers move it to hosts
of their own that scale apart from the trainers. A server runs the local reader unchanged
(``ParquetBatchDataset``, ``SplitReader``, with the caller's ``validate`` and ``transform``)
and sends each batch as one Arrow record batch (``ParquetStreams``, with the caller's
``encode``); the client hands each one to the caller's ``decode``. The service knows record
batches only: what a batch holds, and which digest of its features a server and a client
must share, is the caller's (``dlrmflow.train.launch.reader_servers`` and
``dlrmflow.train.run.data`` compose it with the feature transform).

How the work is divided (the rule). The local loader of a rank runs ``num_workers``
readers (one, read in the training loop, when it is 0); reader ``w`` reads a fixed share of
the rank's splits, and the loader takes one batch from each reader in turn. Remotely, each
of those readers becomes one Flight stream (``do_get``), and the client takes batches from
the streams in the same turn, with the same ``torchdata`` nodes. Stream ``w`` goes to
endpoint ``w mod S`` of the ``S`` endpoints. So the batches, their order and the
``state_dict`` are those of the local loader for any number of servers; to use ``S``
servers at once, set ``num_workers`` to ``S`` or a multiple of it (a server serves several
streams; its ``workers`` bounds how many row groups it preprocesses at once).

The service in pieces, one job each, so that a server's host imports no client and each
side's rules read on their own:

- ``protocol``: what travels between a server and a client (endpoints, the ticket, the
  actions, the errors a server sends on purpose);
- ``security``: what each side trusts the other by (TLS, the shared secret);
- ``server``: the Flight server of record batches, and ``serve`` until a signal;
- ``streams``: what a server serves, a Parquet dataset read by the local reader;
- ``processes``: servers in processes of their own (tests, benchmarks, a run's servers);
- ``client``: a rank's batches from the servers, failing over between them;
- ``calls``: the client's calls to a server, each bounded by a deadline.

This package's ``__init__`` holds no name: each is imported from the module it lives in.
"""
