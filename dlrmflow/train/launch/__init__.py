"""Launching: ``job`` starts a job of ranks on this host under torchrun (``agent``) and
supervises it; ``multihost`` joins a job that spans hosts; ``reader_servers`` builds the
reader service that feeds remote ranks.
"""
