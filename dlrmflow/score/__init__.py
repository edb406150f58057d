"""Score stage: a trained model's predictions for the rows of a dataset, as Parquet.

Above train (it loads checkpoints and servable exports and reads with the trainer's
loaders), below the flows and the CLI, which compose it. ``score.score_dataset`` is the
entry point; ``shares`` says which rows each process reads and what their keys are,
``batches`` reads them, with ``keys`` the key columns copied beside each prediction,
``model`` loads what predicts them, ``output`` owns the output directory (parts,
manifest, resumption), ``worker`` scores one process's share and ``launch`` starts
``--nproc N`` workers.
"""
