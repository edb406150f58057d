"""Model lines: one model trained a day at a time as days arrive, each day a version.

``train_line`` is a line's one driver: it brings in what landed, then for each day the
dataset has gained scores the current model on it (next-day validation), judges it
against the champion (``gate``) and continues it on the day. The ``line`` command calls
it plainly; the recurring flow and its backfill run its steps as Prefect tasks
(``LineSteps``).
"""
