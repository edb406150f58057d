"""One rank's training run: ``trainer.train`` checks the dataset, finds where to start
(``resume``), builds the model and runs ``loop.TrainLoop``, whose steps (``steps``) and
progress (``progress``) are checkpointed (``checkpoint``) into a locked run directory
(``rundir``); ``evaluate`` scores a checkpoint with ``metrics``; ``data`` composes the
loaders; ``rank`` is this process's place in the job.
"""
