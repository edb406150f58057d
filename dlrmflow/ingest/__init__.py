"""Ingest stage: raw data to Parquet, Parquet to Arrow record batches split across ranks,
and the reader service that streams those batches to trainers on other hosts."""
