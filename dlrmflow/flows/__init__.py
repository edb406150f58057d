"""Flows stage: Prefect flows that compose the stages: ingest, train, evaluate, score.

One module per flow: ``ingest`` (generate or convert, then statistics), ``train``,
``evaluate``, ``end_to_end`` (the three as subflows), ``score`` and ``recurring`` (a model
line's scheduled run, day by day). Around them: ``deployments`` (served from this
process, with schedules) and ``deploy`` (to a work pool), ``runners`` (the task runner the
configuration picks), ``policies`` (retries), ``storage`` (where cached results live),
``artifacts`` and ``progress`` (what a run shows in Prefect's UI), ``api`` (the API a
command reports to) and ``settings`` (Prefect's defaults for running with no set-up). No
flow imports the CLI or a benchmark (``tests/test_layout.py``).

Importing this package applies the offline, quiet Prefect defaults before Prefect itself is
imported, so a flow run needs no server, sends no telemetry and keeps the console quiet.
"""

from dlrmflow.flows.settings import configure_prefect_env

configure_prefect_env()
