"""dlrmflow: end-to-end DLRM training from Parquet to evaluation, orchestrated by Prefect."""

__version__ = "0.1.0"
