"""Commands that make and describe datasets: ``generate``, ``convert``, ``schema``,
``register`` and ``stats``."""

from __future__ import annotations

from typing import Annotated

import typer

from dlrmflow.cli.options import ConfigOpt, Progress, SetOpt, echo_json, resolve


def generate(
    out: Annotated[str | None, typer.Option(help="Dataset URL (default: data.url).")] = None,
    days: Annotated[int | None, typer.Option(help="Day partitions; the last is held out.")] = None,
    rows_per_day: Annotated[int | None, typer.Option(help="Rows in each day.")] = None,
    seed: Annotated[int | None, typer.Option(help="Generator seed.")] = None,
    multi_hot: Annotated[
        bool | None, typer.Option("--multi-hot/--one-hot", help="Lists of IDs per feature.")
    ] = None,
    drift: Annotated[
        float | None, typer.Option(help="Day-to-day change of the click model and IDs (0-1).")
    ] = None,
    churn: Annotated[
        float | None,
        typer.Option(help="Share of each feature's IDs born each day, as many dying (0-1)."),
    ] = None,
    shape: Annotated[
        str,
        typer.Option(
            help="criteo: Criteo's layout; logs: a team's click logs (string user and item "
            "IDs, weighted tags, prices), its feature schema declared in the manifest."
        ),
    ] = "criteo",
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Write synthetic click data with a known Bayes AUC as day-partitioned Parquet plus
    manifest.json: Criteo-like (the default) or shaped like a team's own logs.

    Criteo-like days already there with the same settings are kept as they are: one day
    more writes only that day."""
    import posixpath

    from dlrmflow.config import ConfigError
    from dlrmflow.ingest.manifest import listed_paths
    from dlrmflow.ingest.synthetic import generate_dataset
    from dlrmflow.ingest.synthetic_logs import SHAPE, generate_logs_dataset

    generators = {"criteo": generate_dataset, SHAPE: generate_logs_dataset}
    if shape not in generators:
        raise ConfigError(f"--shape must be one of {', '.join(generators)}, not {shape!r}")

    cfg = resolve(
        config,
        set_,
        **{
            "data.url": out,
            "data.days": days,
            "data.rows_per_day": rows_per_day,
            "data.seed": seed,
            "data.multi_hot": multi_hot,
            "data.drift": drift,
            "data.churn": churn,
        },
    )
    before = listed_paths(cfg.data.url) or set()
    bar = Progress(cfg.data.days * cfg.data.rows_per_day, "generate")
    manifest = generators[shape](cfg.data, progress=bar)
    bar.close()
    written = [f.day for f in manifest.files if posixpath.normpath(f.path) not in before]
    echo_json(
        {
            "url": cfg.data.url,
            "rows": manifest.rows,
            "days": manifest.days,
            "test_day": manifest.test_day,
            "positive_rate": manifest.positive_rate,
            "bayes_auc": manifest.bayes_auc,
            "bayes_logloss": manifest.bayes_logloss,
            "written_days": written,
        }
    )


def convert(
    out: Annotated[str, typer.Option(help="Output dataset URL.")],
    input_: Annotated[
        list[str] | None,
        typer.Option("--input", "-i", help="Raw Criteo TSV day files (.gz ok), day 0 first."),
    ] = None,
    input_dir: Annotated[
        str | None,
        typer.Option(help="A landing directory: its files are the days, in name order."),
    ] = None,
    max_bad_fraction: Annotated[
        float, typer.Option(help="Fail when a file has more malformed lines than this.")
    ] = 0.001,
    row_group_size: Annotated[int, typer.Option(help="Rows per Parquet row group.")] = 65_536,
) -> None:
    """Convert raw Criteo TSV days to Parquet, quarantining malformed lines.

    Days converted before from the same files are kept without reading them: converting
    a landing directory again after a file lands writes only the new day."""
    from dlrmflow.config import ConfigError
    from dlrmflow.ingest.criteo.convert import convert_criteo
    from dlrmflow.ingest.criteo.landing import landed_days

    if (input_ is None) == (input_dir is None):
        raise ConfigError("give the raw days as --input files or as one --input-dir")
    if input_dir is not None:
        input_ = landed_days(input_dir)

    bar = Progress(None, "convert", unit="lines")
    result = convert_criteo(
        list(input_ or []),
        out,
        max_bad_fraction=max_bad_fraction,
        row_group_size=row_group_size,
        progress=bar,
    )
    bar.close()
    echo_json(
        {
            "url": out,
            "rows": result.rows,
            "days": result.manifest.days,
            "bad_lines": result.bad_lines,
            "written_days": result.written_days,
            "quarantine": result.quarantine,
        }
    )


def stats(
    data: Annotated[str | None, typer.Option(help="Dataset URL (default: data.url).")] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Per-column statistics of a dataset (missing rates, distinct IDs, dense ranges)."""
    from dlrmflow.ingest.stats.results import write_stats
    from dlrmflow.ingest.stats.scan import dataset_stats

    url = resolve(config, set_, **{"data.url": data}).data.url
    result = dataset_stats(url)
    write_stats(url, result)
    echo_json(result.to_dict())


def register(
    data: Annotated[
        str,
        typer.Option(
            help="Root of the Parquet: day=N/ or dt=YYYY-MM-DD/ folders, or any layout when "
            "the schema names a day_column."
        ),
    ],
    schema: Annotated[
        str, typer.Option(help="The feature schema: a YAML file (label, dense, sparse, ...).")
    ],
) -> None:
    """Register day-partitioned Parquet where it lies under a declared feature schema.

    Checks every file's columns against the schema, writes manifest.json and stats.json
    beside the data (nothing is copied); the last day is the test day. Registering again
    after a day lands reads only the new files' labels."""
    from dlrmflow.ingest.register import register_dataset
    from dlrmflow.schema import read_schema

    declared = read_schema(schema)
    bar = Progress(None, "register")
    manifest = register_dataset(data, declared, progress=bar)
    bar.close()
    echo_json(
        {
            "url": data,
            "rows": manifest.rows,
            "days": manifest.days,
            "test_day": manifest.test_day,
            "positive_rate": manifest.positive_rate,
            "partitions": (manifest.generator or {}).get("partitions"),
            "cardinalities": manifest.cardinalities,
        }
    )


def schema(
    data: Annotated[
        str,
        typer.Option(
            help="Root of the Parquet: day=N/ or dt=YYYY-MM-DD/ folders, or any layout when "
            "the schema names a day_column."
        ),
    ],
    day_column: Annotated[
        str | None,
        typer.Option(
            help="For data not in day folders: the date, timestamp or integer column of each "
            "row's day (each file one day's rows); the guess declares it as day_column."
        ),
    ] = None,
) -> None:
    """Print a feature schema guessed from day-partitioned Parquet, to edit and register.

    Reads every file's footer and the first rows of a few files; each column's line says
    its type, null share, distinct values and list lengths, and the columns left out say
    why. Save it (> schema.yaml), edit it, then: dlrmflow register --schema schema.yaml."""
    from dlrmflow.ingest.infer import infer_schema, schema_yaml

    typer.echo(schema_yaml(infer_schema(data, day_column=day_column)), nl=False)
