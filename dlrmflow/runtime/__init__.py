"""Every private or version-specific runtime piece the platform leans on, one module each.

Each module says what it reaches into and the version it was written against, what it
gains (in words: the measured figures, with their machine, are in its commit history),
and what runs where the piece has moved: a public path, or where there is none, a
one-line ``missing.MissingPiece`` naming the piece and both versions. Its test under
``tests/runtime/`` runs that fallback and fails when the installed version no longer has
the piece. No other module of dlrmflow uses a private name of another library
(``tests/runtime/test_private_hooks.py``), and nothing here imports the rest of dlrmflow
but ``dlrmflow.errors`` (``tests/test_layout.py``).

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
- ``sharded_tensor``: torch's ``ShardedTensor`` (``torch.distributed._shard``), so that
  a sharded checkpoint reshards on load; else ``MissingPiece``.
- ``mkldnn_bf16``: whether oneDNN runs bfloat16 on this CPU, from torch's private
  operator; else the same rule read from ``torch.cpu.get_capabilities()``.
- ``async_assert``: ``torch._assert_async``, the servable export's input check inside the
  exported program; else ``MissingPiece``.
- ``parent_death``: Linux's ``prctl(PR_SET_PDEATHSIG)`` through ``ctypes``, so a child
  dies with the command that started it; else it is not tied to it.
- ``tensorboard_summaries``: hyperparameters written into a TensorBoard run's own event
  file through ``SummaryWriter``'s private file writer; else not written.
- ``missing``: ``MissingPiece``, the error of a piece that is gone with no public path.
"""
