"""dlrmflow: end-to-end DLRM training from Parquet to evaluation, orchestrated by Prefect.

The stages, data flowing one way: ``ingest`` (datasets registered where they lie,
converted or generated; the reader and the reader service), ``features`` (Arrow batches
to tensors) and ``train`` (the model, its sharding plan, one rank's run, jobs of many
ranks, model lines), with ``kernels`` (embedding bags, interaction, codecs) below them
and ``score`` (batch scoring) above. ``flows`` compose the stages as Prefect flows,
``bench`` measures them and ``cli`` is the ``dlrmflow`` command.

Beside the stages: ``config`` (the typed run configuration), ``schema`` (a dataset's
declared features), ``sparse`` (the sparse batch types), ``days`` (which days a run trains
and scores on), ``locks``, ``atomic_writes``, ``memory``, ``supervise``, ``guard`` and
``errors``; ``runtime`` holds every use of another library's private parts.
``tests/test_layout.py`` says which may import which.
"""

__version__ = "0.1.0"
