"""Model lines: one model trained a day at a time as days arrive, each day a version.

``line`` trains a line through the days its dataset has (``train_line``), scoring the
current model on each new day before training on it (next-day validation).
"""
