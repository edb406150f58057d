"""Features stage: the feature spec and the transform from Arrow record batches to tensors.

``spec`` (the feature spec, made from the dataset's declared schema), ``fit`` (the run's
ID mapping fitted from it), ``ids`` (hashing or a vocabulary: raw IDs to rows),
``transform`` (an Arrow row group to a ``Batch``, through ``columns`` (zero-copy views of
Arrow columns), ``checks`` (what it refuses), ``dense`` (dense transforms, labels,
weights) and ``bags`` (ID columns to rows: lists, per-ID weights, crosses, buckets)),
``window`` (a shuffle window's rows placed as read, each batch gathered), ``jit`` (the
compiled loops), ``batch``
(``Batch``, whose sparse part is a ``dlrmflow.sparse.KeyedJaggedTensor``) and ``wire``
(``Batch`` to Arrow and back, for the reader service).
"""
