"""Flows stage: Prefect flows that compose ingest, features and train.

Importing this package applies the offline, quiet Prefect defaults before Prefect itself is
imported, so a flow run needs no server, sends no telemetry and keeps the console quiet.
"""

from dlrmflow.flows.settings import configure_prefect_env

configure_prefect_env()
