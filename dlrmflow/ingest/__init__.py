"""Ingest stage: raw data to Parquet, and Parquet to Arrow record batches split across ranks."""
