"""Kernels below every stage: table-batched embedding bags, the interaction and the codecs.

``tbe`` is the bag (every table of a rank in one flat weight, one lookup for every
feature, the backward fused with the optimizer), laid out by ``tbe_layout``;
``optimizers`` describes each embedding optimizer once; ``backends`` picks what runs a
bag: ``cpu_tbe`` (compiled CPU loops), ``triton_tbe`` (GPU), ``fbgemm_tbe`` (FBGEMM's on
the bag's tensors) or plain torch; ``tiered`` keeps rows on disk behind a DRAM cache;
``interaction`` (``triton_interaction`` on GPUs) is the dot interaction; ``codecs`` the
reduced-precision encodings of the all-to-all. The kernels import no stage
(``tests/test_layout.py``): the sparse batch types they take live in ``dlrmflow.sparse``.
"""
