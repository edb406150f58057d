"""Every private or version-specific runtime piece the platform leans on, one module each.

Each module says what it reaches into and the version it was written against, what it
gains (in words: the measured figures, with their machine, are in its commit history),
and what runs where the piece has moved; its test under ``tests/runtime/`` runs that
fallback and fails when the installed version no longer has the piece. Nothing here
imports the rest of dlrmflow (``tests/kernels/test_layout.py``).

- ``gomp``: a region on torch's own OpenMP threads (libgomp's ``GOMP_parallel``, found in
  the process's mappings), for the compiled TBE step; else a pool of Python threads.
- ``llvm_prefetch``: LLVM's prefetch intrinsic in numba kernels, by the name this LLVM
  gives it; else no prefetch.
- ``glibc_malloc``: ``mallopt`` thresholds and one arena, so a step's large buffers are
  reused; else glibc's defaults.
- ``torchdata_threads``: stopping a torchdata ``Prefetcher``'s thread through its private
  iterator; else the thread is left to end by itself.
- ``teardown``: a gloo job's process ended without Python's teardown, which can abort.
- ``prefect_serve``: the message ``prefect.serve`` prints as it starts, from Prefect's
  private helper (``dlrmflow serve`` runs its own runner); else one line naming the
  deployments.
"""
