"""Train stage: the DLRM, its training loop, checkpoints and evaluation."""
