"""Synthetic Criteo-like click data whose labels come from a known click model.

Real Criteo days are large and cannot be shipped with tests, and a model trained on them has
no known ceiling. This generator writes data with Criteo's layout and marginal shape
(heavy-tailed counts with Criteo's missing rates, Zipf-distributed hashed IDs with Criteo's
cardinalities scaled down) and draws every label from a hidden click model that a DLRM can
represent: per-ID effects, a factorization-machine interaction of per-ID latent vectors and
dense terms. The true click probabilities give the Bayes-optimal AUC and log loss of the
test day, which go into the manifest as the target a trained model is measured against.

Everything is a function of the ``DataConfig`` alone (for one NumPy release, whose random
streams may change between releases): the ground-truth tables come from the seed, and every
row group is drawn from its own RNG keyed by (seed, day, row group), so no row depends on
what was generated before it. Memory is bounded by one day's true probabilities plus the
ground-truth tables (about 56 bytes per ID of every feature), whatever the number of days.

With ``data.drift`` > 0 the days are no longer i.i.d., as logs of a live service are not:
from each day to the next every ID's effect and latent vector move (an AR(1) step with
correlation ``1 - drift``, keeping their variance). A model trained on earlier days goes
stale, and continued training has something to catch up on. Day 0 is the i.i.d. data's
day 0, and the tables keep their size: the manifest's cardinalities are day 0's, the
number of IDs live on any day. New IDs are ``churn``'s (an old ``drift: x``, which also
replaced IDs, reads as ``drift: x`` with ``churn: x`` near enough; see docs/design.md).

With ``data.churn`` > 0 the ID space turns over as a catalogue or a user base does: each
day a ``churn`` share of every feature's IDs is born, each new ID placed at a random
popularity rank with an effect and latent vector of its own; the IDs below each newcomer
move one rank down, so an ID's popularity decays as newer ones arrive, and the IDs
pushed past the last rank stop appearing for good. An ID keeps its effects as it moves.
Churn and drift compose (drift's step first); each day's Bayes metrics are its own.

On days that move, the click rate moves as a live service's does rather than as the
effects' drift would drag it: it follows a random walk in log-odds from
``data.positive_rate``, a ``data.base_rate_step`` step a day (0.03 unless set: a few
percent), plus a weekly cycle of amplitude ``data.weekly``, and each day's bias is set so
that its click model has that rate. Day 0 keeps its bias. The manifest records each such
day's ``target_rate`` and its ``reference_calibration``: the day before's click model (its
effects, latent vectors and bias; nothing for an ID born since) scored on the day's rows,
its predicted clicks over the day's clicks: the miscalibration that even the best model
of the day before has on the day, which next-day validation of a trained model can be
held against.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
import torch

from dlrmflow.config import DataConfig
from dlrmflow.ingest.dayfile import (
    DayFileWriter,
    day_file_writer,
    file_name,
)
from dlrmflow.ingest.generated import day_record, grow_days, unchanged_days
from dlrmflow.ingest.lock import dataset_lock
from dlrmflow.ingest.manifest import (
    DayFile,
    Manifest,
)
from dlrmflow.ingest.schema import (
    CRITEO_CARDINALITIES,
    DENSE,
    SPARSE,
    criteo_schema,
    schema_to_json,
)

# Signal strength of the hidden click model. Together they give a Bayes AUC of 0.77-0.81 on
# the default config, depending on the seed (real Criteo models reach ~0.80). The signal sits
# mostly in frequent IDs (an ID's effect and latent std shrink as rank**-RANK_DECAY) so that a
# DLRM trained on ~1M rows can come close to the Bayes AUC without every rare ID's effect.
ZIPF_EXPONENT = 1.1  # ID popularity ~ rank**-ZIPF_EXPONENT, as in click logs
EFFECT_STD = 0.35  # std of the most popular ID's scalar effect on the logit
LATENT_DIM = 4  # dimension of the per-ID latent vectors of the pairwise interaction term
LATENT_STD = 0.12  # std of each latent coordinate of the most popular ID
RANK_DECAY = 0.35  # an ID's effect and latent std scale as rank**-RANK_DECAY
DENSE_WEIGHT_SCALE = 0.2  # logit change per std of log1p(count), per dense feature
# Mean pooling of L IDs divides a feature's signal variance by up to L (less, as popular IDs
# repeat); multi-hot tables are scaled by mean_length**MULTI_HOT_BOOST to keep the Bayes AUC
# close to the one-hot data's.
MULTI_HOT_BOOST = 0.4

# Rows drawn (from their own RNG stream) to calibrate the bias to the target positive rate.
CALIBRATION_ROWS = 1 << 16
# Multi-hot list lengths are 1 + Poisson(mean - 1) with a per-feature mean log-uniform here.
MULTI_HOT_MEAN_LENGTH = (1.0, 20.0)
# IDs are scattered over [0, 2**_ID_BITS) like Criteo's 32-bit hashed hex IDs.
_ID_BITS = 32
_PROB_EPS = 1e-7

# Per dense feature: (missing rate, median count, std of log1p(count), rate of negatives).
# Missing rates and medians follow the Criteo Kaggle data; I2 alone has small negative
# values (-1, -2, -3) there, which downstream transforms must clip.
_DENSE_SHAPE = (
    (0.45, 1, 1.0, 0.0),
    (0.00, 3, 2.0, 0.05),
    (0.21, 7, 1.5, 0.0),
    (0.22, 4, 0.9, 0.0),
    (0.03, 2800, 1.8, 0.0),
    (0.22, 33, 1.7, 0.0),
    (0.04, 3, 1.5, 0.0),
    (0.001, 7, 1.0, 0.0),
    (0.04, 38, 1.4, 0.0),
    (0.45, 1, 0.5, 0.0),
    (0.04, 1, 1.0, 0.0),
    (0.77, 0, 1.0, 0.0),
    (0.22, 4, 1.0, 0.0),
)
_NEGATIVE_VALUES = np.array([-1, -2, -3])
_NEGATIVE_PROBS = np.array([0.9, 0.07, 0.03])

# Per categorical feature: missing (null) rate, following the Criteo Kaggle data.
_SPARSE_MISSING = {
    "C3": 0.03, "C4": 0.03, "C12": 0.03, "C16": 0.03, "C19": 0.44, "C20": 0.44,
    "C21": 0.03, "C22": 0.76, "C24": 0.03, "C25": 0.44, "C26": 0.44,
}  # fmt: skip

# Part of every day file's name: change it whenever the same parameters start to give other
# rows, so that a new dataset never takes an old file's name (see ``day_file_name``).
GENERATOR_FORMAT = 1

# First word of every SeedSequence key, so the streams can never collide.
_STREAM_ROWS, _STREAM_TABLES, _STREAM_DENSE, _STREAM_CALIBRATION, _STREAM_DRIFT = range(5)
_STREAM_CHURN = 5
_STREAM_BASE_RATE = 6
# The click rate's daily log-odds step on days that move, unless data.base_rate_step says.
BASE_RATE_STEP = 0.03


@dataclass(frozen=True)
class _SparseTruth:
    """One categorical feature of the hidden model, indexed by popularity rank - 1."""

    name: str
    cdf: np.ndarray  # float64 [n]: bounded-Zipf CDF over ranks
    effect: np.ndarray  # float64 [n]: scalar logit effect per ID
    latent: np.ndarray  # float64 [LATENT_DIM, n]: latent vectors, one column per ID
    id_key: np.uint32  # keys the rank -> hashed-ID bijection of this feature
    missing_rate: float
    mean_length: float  # mean list length when multi-hot
    scale: np.ndarray  # float64 [n]: the std of each rank's effect, relative to EFFECT_STD
    # The ID number (before hashing) at each rank: the rank itself until churn moves it.
    id_number: np.ndarray | None = None
    next_id: int = 0  # the first ID number not used yet (churn's new IDs)

    @property
    def cardinality(self) -> int:
        return self.cdf.size


@dataclass(frozen=True)
class _GroundTruth:
    sparse: tuple[_SparseTruth, ...]
    dense_weights: np.ndarray  # float64 [13]: weight per log1p(count) of each dense feature
    bias: float


@dataclass
class _Rows:
    """One chunk of generated features and the (bias-free) true logits behind its labels."""

    dense: list[pa.Array]
    sparse: list[pa.Array]
    logit: np.ndarray  # float64 [rows]


def generate_dataset(
    config: DataConfig,
    url: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Write ``config.days`` day partitions of synthetic data and their manifest.

    The layout is ``URL/day=K/part-<name>.parquet`` for K = 0 .. days-1 (``day_file_name``:
    the name follows from the generation parameters), each with row groups of
    ``config.row_group_size`` rows, then ``URL/manifest.json``. The last day is the test
    day; its Bayes AUC and log loss are computed from the true click probabilities.
    ``url`` overrides ``config.url``; ``progress(n)`` is called with the rows of each row
    group written.

    A dataset already at ``url`` grows: a day it lists under the same file name (the
    same parameters, see ``day_file_name``) and size is kept as it is, neither rewritten
    nor read, so generating ``days + 1`` days writes only the new day and a new manifest.
    Every other day is written beside the old files, the manifest is switched last, and
    only then are the files it no longer lists removed (``publish_manifest``). A failed
    run removes the files it wrote; one that was killed leaves temporaries that the next
    run removes. Each day records the Bayes AUC and log loss of its true probabilities.
    """
    root = url if url is not None else config.url
    if not root:
        raise ValueError("data.url: empty dataset URL")
    if config.seed < 0:
        raise ValueError(f"data.seed must be >= 0 (got {config.seed})")
    with dataset_lock(root, "generate"):
        return _generate(config, root, progress)


def _generate(config: DataConfig, root: str, progress: Callable[[int], None] | None) -> Manifest:
    """``generate_dataset``'s writing, under the dataset's lock (``generated.grow_days``)."""
    truth = _ground_truth(config)
    test_day = config.days - 1
    schema = criteo_schema(config.multi_hot)
    drifting = {"day": 0, "truth": truth}  # the click model of the last day reached
    reached = {0: truth}  # the click models of the last two days reached
    steered = steers_rate(config)

    def truth_of(day: int) -> _GroundTruth:
        """Day ``day``'s click model: each day's is the day before's moved by one step."""
        while drifting["day"] < day:
            drifting["day"] += 1
            if config.drift > 0:
                drifting["truth"] = _drifted(drifting["truth"], config, drifting["day"])
            if config.churn > 0:
                drifting["truth"] = _churned(drifting["truth"], config, drifting["day"])
            if steered:
                drifting["truth"] = _steered(drifting["truth"], config, drifting["day"])
            reached[drifting["day"]] = drifting["truth"]
            reached.pop(drifting["day"] - 2, None)
        return drifting["truth"]

    def write_day(day: int) -> DayFile:
        today = truth_of(day)
        before = _judged_by(today, reached[day - 1]) if steered and day > 0 else None
        with day_file_writer(root, day, day_file_name(config, day), schema) as writer:
            # The one per-day buffer: the exact Bayes AUC needs the whole day at once.
            probs, labels, reference = _write_day(writer, today, config, day, progress, before)
            written = writer.finish()
        record = day_record(day, written, probs, labels, bayes_metrics)
        if not steered:
            return record
        return record.model_copy(
            update={"target_rate": target_rate(config, day), "reference_calibration": reference}
        )

    def manifest_of(files: list[DayFile], positives: int) -> Manifest:
        total_rows = config.rows_per_day * config.days
        return Manifest(
            source="synthetic",
            rows=total_rows,
            days=config.days,
            test_day=test_day,
            positive_rate=positives / total_rows,
            multi_hot=config.multi_hot,
            files=files,
            schema=schema_to_json(schema),
            cardinalities={s.name: s.cardinality for s in truth.sparse},
            bayes_auc=files[test_day].bayes_auc,
            bayes_logloss=files[test_day].bayes_logloss,
            generator=_generator_record(config, truth),
        )

    return grow_days(root, config.days, _kept_days(root, config), write_day, manifest_of, progress)


def _kept_days(root: str, config: DataConfig) -> dict[int, DayFile]:
    """The days of the dataset at ``root`` that generating ``config`` would write again
    byte for byte (``generated.unchanged_days``), with their digest, Bayes metrics and
    this configuration's rows (days from before identities or per-day metrics are written
    again)."""
    _, kept = unchanged_days(root, config.days, lambda day: day_file_name(config, day))
    return {
        day: f
        for day, f in kept.items()
        if None not in (f.digest, f.bytes, f.bayes_logloss) and f.rows == config.rows_per_day
    }


def day_file_name(config: DataConfig, day: int) -> str:
    """The file name of day ``day`` of ``config``'s data: a hash of everything its bytes
    follow from (the parameters, the day, this generator's and the libraries' versions),
    never of other days, so the same day generated again lands on the same name."""
    # What the bytes follow from: not where they go, how many days, which days a run reads
    # (the windows), nor where raw days land.
    parameters = config.model_dump(
        mode="json", exclude={"url", "days", "train_days", "eval_days", "landing"}
    )
    if config.drift == 0:
        del parameters["drift"]  # the i.i.d. days keep the names they had before drift
    else:  # drifting days changed when drift stopped replacing IDs: other bytes, names
        parameters["drift_replaces_ids"] = False
    if config.churn == 0:
        del parameters["churn"]  # and days without churn those they had before it
    if steers_rate(config):
        parameters["base_rate_step"] = base_rate_step(config)
    else:  # days whose rate is not steered keep the names they had before it was
        del parameters["base_rate_step"], parameters["weekly"]
    versions = (GENERATOR_FORMAT, np.__version__, pa.__version__)
    return file_name("synthetic", *versions, sorted(parameters.items()), day)


def _write_day(
    writer: DayFileWriter,
    truth: _GroundTruth,
    config: DataConfig,
    day: int,
    progress: Callable[[int], None] | None,
    before: _GroundTruth | None = None,
) -> tuple[np.ndarray, np.ndarray, float | None]:
    """Write one day file, a row group at a time: its true probabilities and labels (kept
    for the day's Bayes metrics: 9 bytes a row), and, given the day before's click model
    as it sees the day's IDs (``_judged_by``), its calibration on the day."""
    probs_kept: list[np.ndarray] = []
    labels_kept: list[np.ndarray] = []
    predicted_before = 0.0
    schema = criteo_schema(config.multi_hot)
    for chunk, start in enumerate(range(0, config.rows_per_day, config.row_group_size)):
        n = min(config.row_group_size, config.rows_per_day - start)
        rng = seeded_rng(_STREAM_ROWS, config.seed, day, chunk)
        rows = _sample_rows(truth, rng, n, config.multi_hot)
        probs = sigmoid(rows.logit + truth.bias)
        labels = (rng.random(n) < probs).astype(np.int8)
        columns = [pa.array(labels), *rows.dense, *rows.sparse]
        writer.write_table(pa.Table.from_arrays(columns, schema=schema), row_group_size=n)
        probs_kept.append(probs)
        labels_kept.append(labels)
        if before is not None:
            # The same draws (ranks, counts, nulls) under the day before's parameters.
            seen = _sample_rows(before, seeded_rng(_STREAM_ROWS, config.seed, day, chunk), n,
                                config.multi_hot)  # fmt: skip
            predicted_before += float(sigmoid(seen.logit + before.bias).sum())
        if progress is not None:
            progress(n)
    labels = np.concatenate(labels_kept)
    clicks = int(labels.sum())
    reference = predicted_before / clicks if before is not None and clicks else None
    return np.concatenate(probs_kept), labels, reference


def seeded_rng(*key: int) -> np.random.Generator:
    """An independent generator per key: streams never depend on how others were used."""
    return np.random.default_rng(np.random.SeedSequence(list(key)))


def _cardinality(criteo: int, config: DataConfig) -> int:
    return int(min(max(round(criteo * config.cardinality_scale), 2), config.max_cardinality))


def _ground_truth(config: DataConfig) -> _GroundTruth:
    """The hidden click model: per-feature ID tables, dense weights and calibrated bias."""
    sparse = []
    for index, (name, criteo) in enumerate(zip(SPARSE, CRITEO_CARDINALITIES, strict=True)):
        n = _cardinality(criteo, config)
        rng = seeded_rng(_STREAM_TABLES, config.seed, index)
        ranks = np.arange(1, n + 1, dtype=np.float64)
        cdf = np.cumsum(ranks**-ZIPF_EXPONENT)
        cdf /= cdf[-1]
        cdf[-1] = 1.0  # searchsorted of u < 1 must never run past the last rank
        low, high = np.log(MULTI_HOT_MEAN_LENGTH)
        mean_length = float(np.exp(rng.uniform(low, high)))
        scale = ranks**-RANK_DECAY
        if config.multi_hot:
            scale *= mean_length**MULTI_HOT_BOOST
        sparse.append(
            _SparseTruth(
                name=name,
                cdf=cdf,
                effect=rng.normal(0.0, EFFECT_STD, n) * scale,
                latent=rng.normal(0.0, LATENT_STD, (LATENT_DIM, n)) * scale,
                id_key=np.uint32(rng.integers(0, 1 << _ID_BITS)),
                missing_rate=_SPARSE_MISSING.get(name, 0.0),
                mean_length=mean_length,
                scale=scale,
                next_id=n,
            )
        )
    dense_rng = seeded_rng(_STREAM_DENSE, config.seed)
    sigmas = np.array([shape[2] for shape in _DENSE_SHAPE])
    dense_weights = dense_rng.normal(0.0, DENSE_WEIGHT_SCALE, len(DENSE)) / sigmas
    truth = _GroundTruth(tuple(sparse), dense_weights, bias=0.0)

    calibration = _sample_rows(
        truth,
        seeded_rng(_STREAM_CALIBRATION, config.seed),
        CALIBRATION_ROWS,
        config.multi_hot,
    )
    bias = calibrate_bias(calibration.logit, config.positive_rate)
    return _GroundTruth(truth.sparse, truth.dense_weights, bias)


def calibrate_bias(logit: np.ndarray, target: float) -> float:
    """The bias whose mean click probability over ``logit`` is ``target`` (bisection)."""
    low, high = -40.0, 40.0
    for _ in range(60):  # halves an 80-wide bracket to ~1e-16: machine precision
        mid = 0.5 * (low + high)
        if sigmoid(logit + mid).mean() < target:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def _sample_rows(truth: _GroundTruth, rng: np.random.Generator, n: int, multi_hot: bool) -> _Rows:
    """Draw ``n`` rows of features and their true logit (without the bias)."""
    logit = np.zeros(n)
    dense = []
    for (missing_rate, median, sigma, negative_rate), weight in zip(
        _DENSE_SHAPE, truth.dense_weights, strict=True
    ):
        log_count = np.maximum(math.log1p(median) + sigma * rng.standard_normal(n), 0.0)
        values = np.minimum(np.floor(np.expm1(log_count)), np.iinfo(np.int32).max)
        values = values.astype(np.int32)
        if negative_rate > 0:
            negative = rng.random(n) < negative_rate
            values[negative] = rng.choice(_NEGATIVE_VALUES, negative.sum(), p=_NEGATIVE_PROBS)
        missing = rng.random(n) < missing_rate
        # The model sees log1p(max(count, 0)) with nulls as 0, so the truth uses the same.
        logit += weight * np.log1p(np.where(missing, 0, np.maximum(values, 0)))
        dense.append(pa.array(values, mask=missing))

    # Factorization-machine term: sum over feature pairs of <v_i, v_j> is
    # (|sum v|^2 - sum |v|^2) / 2, which is linear in the number of features.
    latent_sum = np.zeros((LATENT_DIM, n))
    latent_sq = np.zeros((LATENT_DIM, n))
    sparse = []
    for feature in truth.sparse:
        if multi_hot:
            column, effect, latent = _multi_hot_feature(feature, rng, n)
        else:
            column, effect, latent = _one_hot_feature(feature, rng, n)
        sparse.append(column)
        logit += effect
        latent_sum += latent
        latent_sq += latent * latent
    logit += 0.5 * (latent_sum * latent_sum - latent_sq).sum(axis=0)
    return _Rows(dense, sparse, logit)


def _one_hot_feature(
    feature: _SparseTruth, rng: np.random.Generator, n: int
) -> tuple[pa.Array, np.ndarray, np.ndarray]:
    """A nullable ID column, its per-row effect and latent vectors (zero where null)."""
    ranks = np.searchsorted(feature.cdf, rng.random(n), side="right")
    present = rng.random(n) >= feature.missing_rate
    effect = feature.effect[ranks] * present
    latent = feature.latent[:, ranks] * present
    column = pa.array(hashed_ids(_numbers(feature, ranks), feature.id_key), mask=~present)
    return column, effect, latent


def _multi_hot_feature(
    feature: _SparseTruth, rng: np.random.Generator, n: int
) -> tuple[pa.Array, np.ndarray, np.ndarray]:
    """A list-of-IDs column (empty where missing) and its mean-pooled effect and latents."""
    present = rng.random(n) >= feature.missing_rate
    lengths = (1 + rng.poisson(feature.mean_length - 1.0, n)) * present
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    ranks = np.searchsorted(feature.cdf, rng.random(int(offsets[-1])), side="right")
    row = np.repeat(np.arange(n), lengths)
    inv_length = 1.0 / np.maximum(lengths, 1)
    effect = np.bincount(row, feature.effect[ranks], minlength=n) * inv_length
    latent = np.stack([np.bincount(row, coord[ranks], minlength=n) for coord in feature.latent])
    latent *= inv_length
    values = pa.array(hashed_ids(_numbers(feature, ranks), feature.id_key))
    column = pa.ListArray.from_arrays(pa.array(offsets), values)
    return column, effect, latent


def _numbers(feature: _SparseTruth, ranks: np.ndarray) -> np.ndarray:
    """The ID numbers at ``ranks`` today (the ranks themselves without churn)."""
    return ranks if feature.id_number is None else feature.id_number[ranks]


def _drifted(truth: _GroundTruth, config: DataConfig, day: int) -> _GroundTruth:
    """The click model of ``day``, one day of ``config.drift`` after ``truth`` (the day
    before's): each ID's effect and latent vector take an AR(1) step."""
    rho = 1.0 - config.drift
    keep, fresh = rho, math.sqrt(1.0 - rho * rho)
    sparse = []
    for index, feature in enumerate(truth.sparse):
        rng = seeded_rng(_STREAM_DRIFT, config.seed, index, day)
        n = feature.cardinality
        effect = keep * feature.effect + fresh * rng.normal(0.0, EFFECT_STD, n) * feature.scale
        noise = rng.normal(0.0, LATENT_STD, (LATENT_DIM, n)) * feature.scale
        latent = keep * feature.latent + fresh * noise
        sparse.append(replace(feature, effect=effect, latent=latent))
    return _GroundTruth(tuple(sparse), truth.dense_weights, truth.bias)


def base_rate_step(config: DataConfig) -> float:
    """The click rate's daily log-odds step: ``data.base_rate_step``, else
    ``BASE_RATE_STEP`` on days that move (drift or churn) and 0 on i.i.d. days."""
    if config.base_rate_step is not None:
        return config.base_rate_step
    return BASE_RATE_STEP if config.drift > 0 or config.churn > 0 else 0.0


def steers_rate(config: DataConfig) -> bool:
    """Whether each day's bias is set to the day's own click rate (``target_rate``)."""
    return base_rate_step(config) > 0 or config.weekly > 0


def target_rate(config: DataConfig, day: int) -> float:
    """Day ``day``'s click rate: ``data.positive_rate`` moved by a random walk in log-odds
    (``base_rate_step`` a day, each step from its own stream) and a weekly cycle."""
    step = base_rate_step(config)
    walk = sum(
        step * float(seeded_rng(_STREAM_BASE_RATE, config.seed, d).standard_normal())
        for d in range(1, day + 1)
    )
    p = config.positive_rate
    logit = math.log(p / (1.0 - p)) + walk + config.weekly * math.sin(2.0 * math.pi * day / 7.0)
    return 1.0 / (1.0 + math.exp(-logit))


def _steered(truth: _GroundTruth, config: DataConfig, day: int) -> _GroundTruth:
    """``truth`` with the bias that gives it day ``day``'s click rate (``target_rate``),
    calibrated on the rows that set day 0's."""
    calibration = _sample_rows(
        truth, seeded_rng(_STREAM_CALIBRATION, config.seed), CALIBRATION_ROWS, config.multi_hot
    )
    bias = calibrate_bias(calibration.logit, target_rate(config, day))
    return replace(truth, bias=bias)


def _judged_by(today: _GroundTruth, before: _GroundTruth) -> _GroundTruth:
    """Today's click model with the day before's parameters: today's popularity (so rows
    drawn from it are today's rows), each ID's effect and latent vector as they were the
    day before (none for an ID born since), the day before's dense weights and bias."""
    sparse = []
    for now, then in zip(today.sparse, before.sparse, strict=True):
        ranks = np.arange(now.cardinality)
        ids, earlier = _numbers(now, ranks), _numbers(then, ranks)
        order = np.argsort(earlier)
        at = order[np.searchsorted(earlier[order], ids).clip(max=len(order) - 1)]
        known = earlier[at] == ids
        sparse.append(
            replace(
                now,
                effect=np.where(known, then.effect[at], 0.0),
                latent=np.where(known, then.latent[:, at], 0.0),
            )
        )
    return _GroundTruth(tuple(sparse), before.dense_weights, before.bias)


def _churned(truth: _GroundTruth, config: DataConfig, day: int) -> _GroundTruth:
    """The click model of ``day`` after one day of ``config.churn``: ``churn`` of each
    feature's IDs are born at random ranks (each with an effect and latent vector drawn
    at its rank's scale), the IDs below move down, and as many at the bottom are dropped.
    """
    sparse = []
    for index, feature in enumerate(truth.sparse):
        rng = seeded_rng(_STREAM_CHURN, config.seed, index, day)
        n = feature.cardinality
        born = min(int(round(config.churn * n)), n)
        numbers = np.arange(n) if feature.id_number is None else feature.id_number
        if born == 0:
            sparse.append(feature)
            continue
        # Where the newcomers end up: ``born`` distinct ranks of the n, each newcomer's
        # rank its final one; the n - born survivors fill the others in their old order.
        ranks = np.sort(rng.choice(n, born, replace=False))
        new = np.zeros(n, np.bool_)
        new[ranks] = True
        scale = feature.scale[ranks]
        effect = np.empty(n)
        effect[~new] = feature.effect[: n - born]
        effect[new] = rng.normal(0.0, EFFECT_STD, born) * scale
        latent = np.empty((LATENT_DIM, n))
        latent[:, ~new] = feature.latent[:, : n - born]
        latent[:, new] = rng.normal(0.0, LATENT_STD, (LATENT_DIM, born)) * scale
        churned = np.empty(n, np.int64)
        churned[~new] = numbers[: n - born]
        churned[new] = feature.next_id + np.arange(born)
        sparse.append(
            replace(
                feature,
                effect=effect,
                latent=latent,
                id_number=churned,
                next_id=feature.next_id + born,
            )
        )
    return _GroundTruth(tuple(sparse), truth.dense_weights, truth.bias)


def hashed_ids(ranks: np.ndarray, key: np.uint32) -> np.ndarray:
    """Scatter 0-based popularity ranks over [0, 2**32) like Criteo's hashed hex IDs.

    Every step (xor with a key, xor-shift, multiply by an odd constant mod 2**32) is a
    bijection of 32-bit integers, so distinct ranks stay distinct IDs and the cardinality
    is exact, while the IDs keep no trace of popularity order. The constants are the
    ``lowbias32`` integer hash; the per-feature key makes each feature's mapping different.
    """
    x = ranks.astype(np.uint32) ^ key
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x.astype(np.int64)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # tanh form: no overflow for large |x|


def bayes_metrics(probs: np.ndarray, labels: np.ndarray) -> tuple[float | None, float]:
    """AUC and log loss of the true probabilities; AUC is None if one class is absent."""
    p = np.clip(probs, _PROB_EPS, 1 - _PROB_EPS)
    logloss = float(-np.mean(np.where(labels == 1, np.log(p), np.log1p(-p))))
    if labels.min() == labels.max():
        return None, logloss
    from torchmetrics.functional.classification import binary_auroc  # heavy: only here

    auc = binary_auroc(torch.from_numpy(probs), torch.from_numpy(labels.astype(np.int64)))
    return float(auc), logloss


def _generator_record(config: DataConfig, truth: _GroundTruth) -> dict[str, object]:
    """Everything needed to tell two synthetic datasets apart, for the manifest."""
    record: dict[str, object] = {
        "seed": config.seed,
        "numpy": np.__version__,
        "rows_per_day": config.rows_per_day,
        "drift": config.drift,
        **({"churn": config.churn} if config.churn else {}),
        **(
            {"base_rate_step": base_rate_step(config), "weekly": config.weekly}
            if steers_rate(config)
            else {}
        ),
        "row_group_size": config.row_group_size,
        "cardinality_scale": config.cardinality_scale,
        "max_cardinality": config.max_cardinality,
        "target_positive_rate": config.positive_rate,
        "zipf_exponent": ZIPF_EXPONENT,
        "effect_std": EFFECT_STD,
        "latent_dim": LATENT_DIM,
        "latent_std": LATENT_STD,
        "rank_decay": RANK_DECAY,
        "dense_weight_scale": DENSE_WEIGHT_SCALE,
        "calibration_rows": CALIBRATION_ROWS,
        "bias": truth.bias,
    }
    if config.multi_hot:
        record["multi_hot_boost"] = MULTI_HOT_BOOST
        record["mean_lengths"] = {s.name: round(s.mean_length, 3) for s in truth.sparse}
    return record
