"""A model line: a directory of successive model versions, one for each day trained.

In production a recommendation model is not trained once: each day's logs arrive, the
model serving is scored on them, continued on them, and the result is the next version.
A line does that on a dataset that grows by a day: ``dlrmflow generate`` with one day
more, raw Criteo files landing in ``data.landing``, or a registered dataset of the team's
own Parquet (``dlrmflow register``) gaining a day partition, which the line registers
before it runs (``Line.land``)::

    LINE/config.json           the line's configuration (fixed when the line starts)
    LINE/run/                  its one run directory, trained in day order
    LINE/versions/NNNN/        a version: version.json (its lineage) and checkpoint/
    LINE/history.jsonl         each day's next-day validation, one record a day
    LINE/history.png           those metrics against the day
    LINE/models/NNNN/          a published version (see ``gate``); models/current: the champion

Every version continues the previous one's weights and optimizer state and trains exactly
on the days it has not seen, in day order (``train.order: days``): the run directory's
window grows by the new days and its checkpoint at the end of the last day continues, so
a line trained a day at a time ends bitwise where one run over the same days ends.
Before a version trains on day d, the newest version is scored on day d (trained on days
up to d-1, tested on d): AUC, log loss, NE, calibration and the share of the day's IDs
never trained on (``unseen``) go into ``history.jsonl``,
and the promotion gate judges it against the champion on that day (``gate``).
Re-running trains nothing; a kill anywhere resumes where the run stood (its checkpoints),
and a version is written only once its day is trained. A configuration that would make
the run another one (``RUN_KEYS``) is refused in one line naming the keys, as
``resume: auto`` refuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from dlrmflow.atomic_writes import write_atomic
from dlrmflow.config import RunConfig, changed_keys, recorded_config
from dlrmflow.days import NONE
from dlrmflow.errors import DlrmflowError
from dlrmflow.ingest.criteo.landing import convert_landed
from dlrmflow.ingest.manifest import MANIFEST_NAME, Manifest, join_url, read_manifest
from dlrmflow.ingest.registered_days import is_registered, register_new_days
from dlrmflow.train.launch.job import launch_evaluation, launch_training
from dlrmflow.train.line.gate import Verdict, champion, judge, publish
from dlrmflow.train.line.registry import log_version, mark_champion, tag_recalibration
from dlrmflow.train.line.unseen import unseen_ids
from dlrmflow.train.run.checkpoint import (
    CHECKPOINTS_DIR,
    DataIdentity,
    list_checkpoints,
    read_checkpoint,
)
from dlrmflow.train.run.recalibration import (
    RECALIBRATION_FILE,
    Recalibration,
    drop_recalibration,
    write_recalibration,
)
from dlrmflow.train.run.resume import RUN_KEYS
from dlrmflow.train.run.rundir import run_dir_lock

LINE_FILE = "config.json"
RUN_DIR = "run"
VERSIONS_DIR = "versions"
VERSION_FILE = "version.json"
GATE_FILE = "gate.json"
HISTORY_FILE = "history.jsonl"
HISTORY_PLOT = "history.png"
# What next-day validation records of each evaluation.
METRICS = ("auc", "logloss", "ne", "ne_recalibrated", "calibration", "positive_rate", "rows")


class LineError(DlrmflowError):
    """A line that cannot go on: another configuration, no day to train, a broken layout."""


@dataclass(frozen=True)
class Version:
    """One version of a line: the model after training through ``day``."""

    number: int
    day: int  # the day this version trained on (its last)
    parent: int | None  # the version it continued
    days: list[int]  # every day its weights have seen, in the order seen
    steps: int  # the run's steps at its end
    rows: int
    final_loss: float
    config_digest: str
    day_digests: list[str]  # each day's files, as its checkpoint records them
    validation: dict[str, Any] | None  # the parent scored on ``day`` before training on it
    # Dynamic tables: the IDs its training admitted and evicted, and its rows in use.
    id_maps: dict[str, dict[str, int]] = field(default_factory=dict)
    # The shift of its logit fitted on rows of the next day, once validated there
    # (``train.run.recalibration.Recalibration``); its checkpoint carries it too.
    recalibration: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return f"{self.number:04d}"


def line_config(line_dir: Path, config: RunConfig | None) -> RunConfig:
    """The line's configuration: ``config`` when the line starts (written to
    ``config.json``), the recorded one afterwards. A ``config`` given to a started line
    must be the same run (a ``RUN_KEYS`` key or the dataset that differs is refused), and
    is this call's: how it runs (ranks, logging, checkpoints) may change.

    A line has started once it has a version or a checkpoint. Before, a given ``config``
    replaces the recorded one: a first call that failed (a mistyped ``--data``) leaves
    nothing a corrected call must match. An unreadable ``config.json`` is one line naming
    it; given the configuration again, the line rewrites it, checked against the newest
    version's checkpoint (which records the configuration it trained with)."""
    path = line_dir / LINE_FILE
    if config is not None:
        _refuse_run_length("the configuration given", config)
    if not path.is_file() and config is None:
        raise LineError(f"{line_dir}: no {LINE_FILE}; start the line with a configuration")
    recorded = _recorded(path, config) if path.is_file() else None
    if recorded is not None:
        _refuse_run_length(str(path), recorded)
        if config is None:
            return _as_line(line_dir, recorded)
    assert config is not None
    given = _as_line(line_dir, config)  # compared as the line runs it
    newest = _newest_checkpoint(line_dir)
    if newest is not None:
        if recorded is not None:
            _refuse_another_run(path, recorded, given)
            return given
        trained = _as_line(line_dir, recorded_config(read_checkpoint(newest).manifest["config"]))
        _refuse_another_run(newest, trained, given)
    line_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(given.model_dump(mode="json"), indent=1) + "\n")
    return given


def _recorded(path: Path, config: RunConfig | None) -> RunConfig | None:
    """The configuration ``config.json`` records; None when it cannot be read and a
    ``config`` is given to rewrite it."""
    try:
        return recorded_config(json.loads(path.read_text()))
    except (ValueError, OSError) as e:
        if config is not None:
            return None
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise LineError(
            f"{path}: unreadable ({cause}); give the line's configuration again "
            "(--config FILE, or --data and --set as it started) to rewrite it"
        ) from e


def _newest_checkpoint(line_dir: Path) -> Path | None:
    """What the line has trained: its newest version's checkpoint, else the run's newest
    (a first day killed before its version was written); None before any training."""
    made = versions(line_dir)
    if made:
        return line_dir / VERSIONS_DIR / made[-1].name / "checkpoint"
    found = list_checkpoints(line_dir / RUN_DIR)
    return found[-1].path if found else None


def _as_line(line_dir: Path, config: RunConfig) -> RunConfig:
    """``config`` as the line's run: its run directory, day order, resumed, no held-out
    day (each new day validates the model instead)."""
    line = config.model_copy(deep=True)
    line.run_dir = str(line_dir / RUN_DIR)
    line.train.order = "days"
    line.train.epochs = 1
    line.train.resume = "auto"
    line.data.train_days = None
    line.data.eval_days = NONE
    return line


# Keys that cut a run short of its days, and the value under which a line can honour them:
# a version is its day trained whole, so a cap would record days its weights never saw.
RUN_LENGTH = {"train.max_steps": None, "train.epochs": 1}


def _refuse_run_length(source: str, config: RunConfig) -> None:
    for key, allowed in RUN_LENGTH.items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if value != allowed:
            raise LineError(
                f"{source}: {key}={value}: a line trains each new day whole, once (a "
                f"version a day), so it cannot honour {key}; leave it unset"
            )


def _refuse_another_run(path: Path, recorded: RunConfig, config: RunConfig) -> None:
    changed = changed_keys(recorded, config, [*RUN_KEYS, "data.url"])
    if changed:
        shown = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
        raise LineError(
            f"{path}: the line was started with another configuration: {shown}; "
            "start another line for it"
        )


def versions(line_dir: Path) -> list[Version]:
    """The line's versions, oldest first."""
    root = line_dir / VERSIONS_DIR
    found = []
    for path in sorted(root.glob("[0-9][0-9][0-9][0-9]")) if root.is_dir() else []:
        record = path / VERSION_FILE
        if record.is_file():
            found.append(Version(**json.loads(record.read_text())))
    return found


def history(line_dir: Path) -> list[dict[str, Any]]:
    """The next-day validation records, one per day, in day order: ``history.jsonl``'s,
    and each version's own (``version.json`` keeps the record of the day it trained on),
    so a history removed or cut short is whole again. A line that is not a record is one
    line naming the file, the line and the cause."""
    records = {v.validation["day"]: v.validation for v in versions(line_dir) if v.validation}
    path = line_dir / HISTORY_FILE
    lines = path.read_text().splitlines() if path.is_file() else []
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
            records[int(record["day"])] = record
        except (ValueError, KeyError, TypeError) as e:
            raise LineError(
                f"{path}: line {number} is not a validation record ({e}); remove that line "
                f"(or the file: the trained days' records are kept in versions/NNNN/"
                f"{VERSION_FILE} too, and a day not trained yet is validated again)"
            ) from e
    return [records[day] for day in sorted(records)]


class Line:
    """A line opened for training (see ``open_line``): its configuration, the days it has
    still to train on, and ``advance``, which makes the next version."""

    def __init__(self, line_dir: Path, config: RunConfig) -> None:
        self.dir = line_dir
        self.config = config
        self.versions = versions(line_dir)

    @property
    def lands(self) -> bool:
        """Whether the line's dataset grows by what lands rather than by other means: raw
        files in ``data.landing``, or day partitions under a registered dataset. Read by
        ``land`` and by the recurring flow alike, so both ingest the same way."""
        return self.config.data.landing is not None or is_registered(self.config.data.url)

    def land(self) -> list[int]:
        """Bring in the days that landed since the last call; the days gained. Raw files
        in ``data.landing`` are converted into the dataset (``convert_landed``); under a
        registered dataset, new day partitions are registered as its next days, under the
        schema its manifest records (``register_new_days``). Either way a day, once in the
        dataset, keeps its number and files for good: a late file or partition, or a day's
        file rewritten, is refused in one line naming it before anything is scored."""
        if not self.lands:
            return []
        landing = self.config.data.landing
        if landing is None:
            return register_new_days(self.config.data.url).new_days
        result = convert_landed(
            landing, self.config.data.url, row_group_size=self.config.data.row_group_size
        )
        return result.written_days

    def pending(self, through: int | None = None) -> list[int]:
        """The dataset's days the line has not trained on, in order, through ``through`` at
        most: a day the dataset lacks yet is left for a later call, and one trained
        already leaves nothing to do. The days it trained on are checked first to be the
        files it trained on (``check_data``): nothing is scored or recorded on another
        dataset."""
        url = self.config.data.url
        if through is not None and through < 0:
            raise LineError(f"--through {through}: days are numbered from 0")
        manifest = read_manifest(url)
        self.check_data(manifest)
        days = sorted({f.day for f in manifest.files})
        seen = [v.day for v in self.versions]
        if seen and seen != days[: len(seen)]:
            raise LineError(
                f"{self.dir}: its versions trained days {seen}, which are not the first days "
                f"of {url} ({days[: len(seen)]})"
            )
        return [d for d in days[len(seen) :] if through is None or d <= through]

    def check_data(self, manifest: Manifest) -> None:
        """Refuse a dataset whose days the line trained on are no longer the files it
        trained on (regenerated with another seed, converted again, renumbered): each is
        compared with the digests its newest version recorded, before anything is scored,
        judged or written, so no record is ever made from data the line would refuse."""
        if not self.versions:
            return
        newest = self.versions[-1]
        now = DataIdentity.of(manifest, newest.days).day_digests
        for day, kept, found in zip(newest.days, newest.day_digests, now, strict=True):
            if kept != found:
                where = join_url(self.config.data.url, MANIFEST_NAME)
                what = (
                    "its files are not the ones"
                    if any(f.day == day for f in manifest.files)
                    else "no file, but"
                )
                raise LineError(
                    f"{where}: day {day}: {what} version {newest.name} trained on (the "
                    "dataset was regenerated, converted again or renumbered); restore the "
                    "line's data, or start another line on this one"
                )

    def advance(self, day: int) -> Version:
        """Score the newest version on ``day`` (next-day validation), judge it against
        the champion there (the gate), then train on ``day``: the next version."""
        parent = self.versions[-1] if self.versions else None
        first = self.versions[0].day if self.versions else day  # the run's window starts there
        validation = None
        if parent is not None:
            manifest = read_manifest(self.config.data.url)
            digest = day_digest(manifest, day)
            validation = _validate(self.dir, self.config, day, manifest, digest, parent)
            if validation.get("recalibration") is not None:
                parent = replace(parent, recalibration=validation["recalibration"])
                self.versions[-1] = parent
            _gate(self.dir, self.config, parent, day, digest, validation)
        version = _train_day(self.dir, self.config, first, day, parent, validation)
        self.versions.append(version)
        return version


@contextmanager
def open_line(line_dir: str | Path, config: RunConfig | None = None) -> Iterator[Line]:
    """The line at ``line_dir``, locked against a second writer while open. ``config``
    starts the line (or must match it, see ``line_config``)."""
    line_dir = Path(line_dir)
    with run_dir_lock(line_dir, "dlrmflow line"):
        opened = Line(line_dir, line_config(line_dir, config))
        _restore_run(line_dir, opened.versions)
        for version in opened.versions:  # one a killed call wrote but did not log
            log_version(opened.config, line_dir, line_dir / VERSIONS_DIR / version.name)
        yield opened


def _restore_run(line_dir: Path, made: list[Version]) -> None:
    """Give a run directory that lost its checkpoints (``LINE/run/`` deleted) the newest
    version's, hard-linked: it is the run's checkpoint at the end of that version's day,
    so the line continues bitwise where it stood instead of training every day again."""
    run = line_dir / RUN_DIR
    if not made or list_checkpoints(run):
        return
    source = line_dir / VERSIONS_DIR / made[-1].name / "checkpoint"
    step = int(read_checkpoint(source).manifest["step"])
    target = run / CHECKPOINTS_DIR / f"step_{step:09d}"
    partial = target.with_name(f".restored-{target.name}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    # Not its recalibration: the run's own checkpoints carry none (it is the version's).
    ignore = shutil.ignore_patterns(RECALIBRATION_FILE)
    shutil.copytree(source, partial, copy_function=os.link, ignore=ignore)
    partial.rename(target)


class LineSteps:
    """How ``train_line`` runs its two steps: bringing in what landed (``Line.land``) and
    a day (``Line.advance``: validate, gate, train). Called plainly here, as the ``line``
    command runs them; the recurring flow overrides both to run them as Prefect tasks
    (``dlrmflow.flows.recurring``), so the sequence around them is written once, in
    ``train_line``, whoever runs it."""

    def land(self, line: Line) -> list[int]:
        """The days gained by what landed."""
        return line.land()

    def day(self, line: Line, day: int) -> Version:
        """The version trained on ``day``, after validating and judging the newest one."""
        return line.advance(day)


@dataclass(frozen=True)
class LineRun:
    """What one ``train_line`` call did: what the recurring flow and the CLI report."""

    dir: Path
    config: RunConfig  # the line's, as this call ran it
    landed: list[int]  # the days brought in by what landed
    made: list[Version]  # the versions made, a day each, in day order
    left: list[int]  # new days left for a later call (``max_days``)
    judged: list[Verdict]  # the gate's verdicts made in this call, oldest first
    plot: Path | None  # ``history.png``, redrawn when a version was made


def train_line(
    line_dir: str | Path,
    config: RunConfig | None = None,
    *,
    through: int | None = None,
    max_days: int | None = None,
    steps: LineSteps | None = None,
) -> LineRun:
    """The one driver of a model line, for the ``line`` command, the recurring flow and
    its backfill alike: bring in what landed (``Line.land``: raw files in
    ``data.landing``, or new day partitions under a registered dataset), then, for each
    day of the dataset the line at ``line_dir`` has not trained on (through ``through``,
    at most ``max_days`` of them), score the newest version on it, judge it against the
    champion and continue it on the day: a version a day (``Line.advance``). ``steps``
    says how those two steps run (plainly by default; the flow's as Prefect tasks).
    ``config`` starts the line (or must match it, see ``line_config``)."""
    if max_days is not None and max_days < 1:
        raise LineError(f"max_days must be >= 1 (got {max_days})")
    steps = LineSteps() if steps is None else steps
    with open_line(line_dir, config) as line:
        landed = steps.land(line) if line.lands else []
        judged_before = len(verdicts(line.dir))
        days = line.pending(through)
        todo = days if max_days is None else days[:max_days]
        made = [steps.day(line, day) for day in todo]
        plot = plot_history(line.dir) if made else None
        judged = verdicts(line.dir)[judged_before:]
    return LineRun(line.dir, line.config, landed, made, days[len(todo) :], judged, plot)


def _score(
    line: RunConfig,
    day: int,
    checkpoint: Path | None = None,
    recalibrate: float | None = None,
    recalibrate_rows: str = "spread",
) -> dict[str, Any]:
    """A version (the run's newest, or ``checkpoint``, with the recalibration it carries)
    scored on ``day``; with ``recalibrate``, a recalibration fitted on that share of the
    day's rows (``recalibrate_rows``: which) and judged on the rest (``recalibration``)."""
    metrics = launch_evaluation(
        line.run_dir,
        line.distributed.nproc,
        checkpoint=None if checkpoint is None else str(checkpoint),
        distributed=line.distributed,
        device=line.train.device,
        kernels=line.model.kernels,
        eval_days=[day],
        recalibrate=recalibrate,
        recalibrate_rows=recalibrate_rows,
    )
    assert metrics is not None  # this host is node 0: the line runs there
    scored = {"day": day, **{k: metrics[k] for k in METRICS}, "step": metrics["step"]}
    if "recalibration_fitted" in metrics:
        scored["recalibration"] = metrics["recalibration_fitted"]
    if "recalibration_skipped" in metrics:
        scored["recalibration_skipped"] = metrics["recalibration_skipped"]
    if "id_maps" in metrics:
        scored["id_maps"] = {
            name: {"default_share": c["default_share"]} for name, c in metrics["id_maps"].items()
        }
    return scored


def day_digest(manifest: Manifest, day: int) -> str:
    """The identity of ``day``'s files (their paths, rows and digests), as a checkpoint
    records it: what a record scored on the day was scored on."""
    return DataIdentity.of(manifest, [day]).day_digests[0]


def _gate(
    line_dir: Path,
    line: RunConfig,
    version: Version,
    day: int,
    digest: str,
    metrics: dict[str, Any],
) -> Verdict:
    """Judge ``version`` against the champion on ``day`` (see ``gate``), once, and publish
    it if it passes: its verdict is kept in ``versions/NNNN/gate.json``. A verdict made on
    other files of the day (``digest``: the data changed since) is made again, never
    kept."""
    path = line_dir / VERSIONS_DIR / version.name / GATE_FILE
    kept = Verdict(**json.loads(path.read_text())) if path.is_file() else None
    if kept is not None and kept.day == day and kept.day_digest == digest:
        verdict = kept
    else:
        serving = champion(line_dir)
        against = None
        if serving is not None:
            served = line_dir / VERSIONS_DIR / f"{serving:04d}" / "checkpoint"
            if not (served / "manifest.json").is_file():
                raise LineError(
                    f"{served}: the champion's checkpoint is gone, and the gate scores the "
                    "champion with it: restore the version's directory"
                )
            against = (serving, _score(line, day, served))
        judged = judge(version.number, day, metrics, against, line.gate)
        verdict = replace(judged, day_digest=digest)
        write_atomic(path, json.dumps(asdict(verdict), indent=1) + "\n")
    serving = champion(line_dir)
    if verdict.promoted and (serving is None or serving < version.number):
        checkpoint = line_dir / VERSIONS_DIR / version.name / "checkpoint"
        publish(line_dir, checkpoint, asdict(version), verdict)
        mark_champion(line, line_dir / VERSIONS_DIR / version.name)
    return verdict


def verdicts(line_dir: Path) -> list[Verdict]:
    """The gate's verdicts so far, oldest version first."""
    root = line_dir / VERSIONS_DIR
    found = sorted(root.glob(f"[0-9][0-9][0-9][0-9]/{GATE_FILE}")) if root.is_dir() else []
    return [Verdict(**json.loads(path.read_text())) for path in found]


def _validate(
    line_dir: Path,
    line: RunConfig,
    day: int,
    manifest: Manifest,
    digest: str,
    version: Version,
) -> dict[str, Any]:
    """The newest ``version`` (its own checkpoint, whatever the run directory holds)
    scored on ``day``, with the share of the day's IDs it never saw (``unseen``), once: a
    day already in the history keeps its record, unless it was scored on other files of
    the day (``digest``, the record's ``day_digest``, of the dataset's ``manifest``),
    which it then replaces.

    Beside the scores, what says whose fault a miscalibration is: the day's click rate
    over the rate of the days the version trained on (``base_rate_ratio``: a model
    calibrated on those days scores about its inverse), the NE that miscalibration does
    not count (``ne_recalibrated``, among the scores) and, on synthetic days that record
    it, the calibration the day before's Bayes model gets on the day
    (``reference_calibration``)."""
    records = history(line_dir)
    for record in records:
        if record["day"] == day and record.get("day_digest") == digest:
            return record
    unseen = unseen_ids(line_dir, line.data.url, day, version.days)
    checkpoint = line_dir / VERSIONS_DIR / version.name / "checkpoint"
    share = line.gate.recalibration_share or None
    if share is not None:
        # Fitted on the version's own predictions, never on a shift fitted before (a run
        # killed after writing it, before the history).
        drop_recalibration(checkpoint)
    scored = _score(line, day, checkpoint, share, line.gate.recalibration_rows)
    record = {**scored, "unseen_ids": unseen, "day_digest": digest}
    record.update(_rate_change(manifest, day, version.days))
    if version.id_maps:
        # Dynamic tables: what the version's training admitted and evicted, and how many
        # of the next day's lookups found no row of their own.
        record["id_maps"] = {
            name: {**counts, **record.get("id_maps", {}).get(name, {})}
            for name, counts in version.id_maps.items()
        }
    if record.get("recalibration") is not None:
        # The version's checkpoint carries it to every reader (evaluate, score, export and
        # the published model); version.json records it, the history last of all.
        write_recalibration(checkpoint, Recalibration(**record["recalibration"]))
        path = line_dir / VERSIONS_DIR / version.name / VERSION_FILE
        lineage = {**json.loads(path.read_text()), "recalibration": record["recalibration"]}
        write_atomic(path, json.dumps(lineage, indent=1) + "\n")
        tag_recalibration(line, path.parent, record["recalibration"])
    kept = [r for r in records if r["day"] != day]
    text = "".join(json.dumps(r) + "\n" for r in sorted([*kept, record], key=lambda r: r["day"]))
    # Rewritten whole and renamed: a kill leaves the old history or the new, never half.
    write_atomic(line_dir / HISTORY_FILE, text)
    return record


def _rate_change(manifest: Manifest, day: int, trained: list[int]) -> dict[str, float]:
    """``day``'s click rate over that of the days ``trained`` (rows weighted), and the
    day's reference calibration where the generator recorded one."""
    files = [f for f in manifest.files if f.day in trained]
    rows = sum(f.rows for f in files)
    scored = [f for f in manifest.files if f.day == day]
    if not rows or not scored:
        return {}
    rate = sum(f.rows * f.positive_rate for f in files) / rows
    day_rows = sum(f.rows for f in scored)
    day_rate = sum(f.rows * f.positive_rate for f in scored) / day_rows
    change = {"base_rate_ratio": day_rate / rate} if rate > 0 else {}
    references = [f.reference_calibration for f in scored if f.reference_calibration is not None]
    if len(references) == len(scored) == 1:
        change["reference_calibration"] = references[0]
    return change


def _train_day(
    line_dir: Path,
    line: RunConfig,
    first: int,
    day: int,
    parent: Version | None,
    validation: dict[str, Any] | None,
) -> Version:
    """Train the run through ``day`` and keep its checkpoint as the next version."""
    config = line.model_copy(deep=True)
    config.data.train_days = f"{first}-{day}"
    result = launch_training(config)
    assert result is not None
    checkpoint = Path(result.checkpoint)
    manifest = read_checkpoint(checkpoint).manifest
    number = 0 if parent is None else parent.number + 1
    version = Version(
        number=number,
        day=day,
        parent=None if parent is None else parent.number,
        days=list(manifest["train_days"]),
        steps=result.steps,
        rows=result.rows,
        final_loss=result.final_loss,
        config_digest=_config_digest(config),
        day_digests=list(manifest["train_day_digests"]),
        validation=validation,
        id_maps=result.id_maps,
    )
    target = line_dir / VERSIONS_DIR / version.name
    partial = target.with_name(f".partial-{version.name}")
    shutil.rmtree(partial, ignore_errors=True)
    # Hard links: the run prunes its checkpoints, the version keeps the files.
    shutil.copytree(checkpoint, partial / "checkpoint", copy_function=os.link)
    write_atomic(partial / VERSION_FILE, json.dumps(asdict(version), indent=1) + "\n")
    partial.rename(target)
    log_version(line, line_dir, target)
    return version


def _config_digest(config: RunConfig) -> str:
    """What the version was trained with, wherever its line lives (not ``run_dir``)."""
    text = json.dumps(config.model_dump(mode="json", exclude={"run_dir"}), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _plotted(record: dict[str, Any], name: str) -> float | None:
    if name == "inverse_base_rate_ratio":  # a calibrated model's calibration after the move
        ratio = record.get("base_rate_ratio")
        return None if not ratio else 1.0 / ratio
    if name == "calibration_recalibrated":
        fitted = record.get("recalibration")
        return None if not fitted else fitted["after"]["calibration"]
    return record.get(name)


def plot_history(line_dir: Path) -> Path | None:
    """Each next-day metric against the day, to ``history.png`` (None without history)."""
    records = history(line_dir)
    if not records:
        return None
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 5), layout="constrained")
    # Each panel's metric, and those drawn beside it: the NE that miscalibration does not
    # count, the calibration once recalibrated (on the rows its shift was not fitted on),
    # and what the day's rate change alone would do to a model's calibration.
    panels = {
        "auc": (),
        "logloss": (),
        "unseen_ids": (),
        "ne": ("ne_recalibrated",),
        "calibration": (
            "calibration_recalibrated",
            "reference_calibration",
            "inverse_base_rate_ratio",
        ),
    }
    for i, (key, beside) in enumerate(panels.items()):
        axes = figure.add_subplot(2, 3, i + 1)
        for name in (key, *beside):
            shown = [(r["day"], _plotted(r, name)) for r in records]
            shown = [(day, value) for day, value in shown if value is not None]
            if shown:
                days, values = zip(*shown, strict=True)
                axes.plot(days, values, marker="o" if name == key else ".", label=name)
        axes.set_xlabel("day")
        axes.set_ylabel(f"next-day {key}")
        if beside:
            axes.legend(fontsize="small")
        axes.grid(alpha=0.3)
    path = line_dir / HISTORY_PLOT
    figure.savefig(path, dpi=100, format="png")
    return path
