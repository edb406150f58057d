"""One rank's training run: ``trainer.train`` checks the dataset, finds where to start
(``resume``), builds the model and runs ``loop.TrainLoop``, whose steps (``steps``, their
loss ``loss`` at the rates of ``schedule``) and progress (``progress``) are checkpointed
(``checkpoint``) into a locked run directory (``rundir``) and logged to a tracker
(``tracking``); ``evaluate`` scores a checkpoint with ``metrics`` and ``calibration``;
``export`` writes a checkpoint as safetensors and ``servable`` as a ``torch.export``
program, whose raw inputs ``recipe`` describes; ``data`` composes the loaders; ``rank`` is
this process's place in the job.
"""
