"""Train stage: the DLRM, its sharding plan, a rank's run, jobs of ranks and model lines.

Five folders, each importing only those before it in this list
(``tests/test_layout.py``):

- ``model``: the DLRM and what parallelizes it (embeddings in memory, on disk or sharded
  by a plan, DDP, device, precision).
- ``planner``: the sharding plan, from a cost model.
- ``run``: one rank's training run (the loop, its steps, progress, checkpoints, evaluation,
  metrics, exports, the run directory) and its data.
- ``launch``: jobs of many ranks on one host or many, their agent and reader servers.
- ``line``: model lines, one model trained a day at a time as days arrive.

``python -m dlrmflow.train`` (``__main__``) is one rank of a job.
"""
