"""The model: one ``DLRM`` (``dlrm``), built plain and parallelized by ``parallelize``.

``embeddings`` is the interface every embedding collection offers and the two that live
in one process (in memory, or on disk when ``memory_budget`` says they do not fit);
``sharded/`` executes a ``plan`` across ranks with ``comms``, in pieces by job
(``routing``, ``input_dist``, ``lookup``, ``output_dist``, ``checkpoint``, ``tiers``,
composed by ``collection``); ``device`` says where a rank computes.
"""
