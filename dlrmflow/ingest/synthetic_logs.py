"""Synthetic click logs in a team's shape, not Criteo's, with a known Bayes-optimal AUC.

Criteo's layout (``ingest.synthetic``) is one preset; a team's logs look otherwise: string
user and item IDs, a list of IDs with a weight for each, float features with nulls and
the odd bad value, and a request ID that is not a feature. This generator writes such
logs (``dlrmflow generate --shape logs``), declares their feature schema in the manifest
as ``dlrmflow register`` does for a user's own data, and draws every click from a hidden
model whose true probabilities give the test day's Bayes AUC and log loss, so that every
stage is exercised, and measured, on data that is not Criteo's.

A day file's columns:

* ``click`` (int8): the label;
* ``request_id`` (int64): a key, unique in the dataset (the day in the high 32 bits);
* ``user_id`` (string, null for logged-out requests) and ``item_id`` (string):
  Zipf-popular IDs whose strings say nothing of their popularity;
* ``recent_items`` (list of string: the items the user interacted with recently, the
  same IDs as ``item_id`` drawn from the same popularity; Poisson lengths, some null or
  empty): declared with ``item_id`` in one shared table, ``items``;
* ``price`` (float32, log-normal, some nulls) and ``discount`` (float32, the share taken
  off, some nulls, and a few logging errors outside [0, 1] that the declared clip removes);
* ``tags`` (list of int64, Poisson lengths, some null or empty) and ``tags_weight`` (list
  of float32 aligned with ``tags``: how strongly each tag applies, log-normal with mean 1).

The click model's logit is a bias (calibrated to ``data.positive_rate``), the user's and
the item's effects, a user x item interaction (the dot of their latent vectors, which the
DLRM's dot interaction represents), ``RECENT_WEIGHT`` times the sum of the recent items'
effects (the very effects of ``item_id``, so that an item's row learnt from either column
serves the other: what the shared table is for; a sum, as the model's sum pooling takes
it), the *weighted* sum of the tags' effects, and linear terms in ``log(1 + price)`` and
the clipped discount: in each case the value the declared transform hands the model (a
null as the declared fill, a null list as an empty one). A model that pools the tags
with their weights can reach the Bayes AUC; one that ignores the weights cannot: the
generator record says how far below it the true model falls with every weight replaced by
its mean (``auc_list_weights_ignored``).

As in ``ingest.synthetic``, everything follows from the ``DataConfig`` alone: the hidden
tables come from the seed, each row group from its own RNG keyed by (seed, day, row
group), so no row depends on what was generated before it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dlrmflow.config import ConfigError, DataConfig
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
from dlrmflow.ingest.schema import schema_to_json
from dlrmflow.ingest.stats.results import write_stats
from dlrmflow.ingest.stats.scan import dataset_stats

# The Bayes metrics, bias calibration and ID scatter are the Criteo-shaped generator's, so
# that both shapes' recorded optima are computed alike.
from dlrmflow.ingest.synthetic import (
    bayes_metrics,
    calibrate_bias,
    hashed_ids,
    seeded_rng,
    sigmoid,
)
from dlrmflow.schema import DenseFeature, FeatureSchema, SparseFeature

SHAPE = "logs"

# Distinct IDs at data.cardinality_scale 1 (scaled down, at least 2, at most
# data.max_cardinality): many users, fewer items, a small vocabulary of tags.
USERS, ITEMS, TAGS = 5_000_000, 1_000_000, 200_000
ZIPF_EXPONENT = 1.1  # ID popularity ~ rank**-ZIPF_EXPONENT, as in click logs
# An ID's effect and latent std scale as rank**-RANK_DECAY: the signal sits mostly in
# frequent IDs, so that a model trained on little data can come close to the Bayes AUC.
RANK_DECAY = 0.35
USER_EFFECT_STD = 0.4  # std of the most popular ID's logit effect, per table
ITEM_EFFECT_STD = 0.4
TAG_EFFECT_STD = 0.5
LATENT_DIM = 4  # the user x item interaction's latent vectors
LATENT_STD = 0.35
USER_MISSING = 0.02  # logged-out requests: a null user ID
TAGS_MEAN_LENGTH = 4.0  # Poisson mean of a list's length (0 gives an empty list)
TAGS_MISSING = 0.03  # a null list
# log(weight) ~ N(-s^2/2, s): mean 1, and spread enough that the weights matter.
TAG_WEIGHT_SIGMA = 1.0
RECENT_MEAN_LENGTH = 3.0  # Poisson mean of recent_items' length (0 gives an empty list)
RECENT_MISSING = 0.02  # a null recent_items list (no history logged)
# Logit change per unit of the recent items' summed item effects: their term's variance
# is about 0.7 of item_id's own effect's, so the shared table matters without dominating.
RECENT_WEIGHT = 0.5
PRICE_MEDIAN, PRICE_SIGMA, PRICE_MISSING = 20.0, 1.0, 0.05
PRICE_WEIGHT = -0.3  # logit change per unit of log(1 + price)
DISCOUNT_MEAN, DISCOUNT_STD, DISCOUNT_MISSING = 0.15, 0.12, 0.04
DISCOUNT_ERRORS = 0.01  # share of logged discounts outside [0, 1]: -1 or 100 (a percent)
DISCOUNT_WEIGHT = 1.5  # logit change per unit of the clipped discount

# Rows drawn (from their own stream) to calibrate the bias to the target positive rate.
CALIBRATION_ROWS = 1 << 16

# Part of every day file's name: change it whenever the same parameters start to give other
# rows, so that a new dataset never takes an old file's name.
GENERATOR_FORMAT = 2  # 2: recent_items, and its term in the click model

# First word of every SeedSequence key: never one of the Criteo-shaped generator's streams.
_SHAPE_KEY = 0x6C6F6773  # "logs"
_STREAM_ROWS, _STREAM_TABLES, _STREAM_CALIBRATION = range(3)

ARROW_SCHEMA = pa.schema(
    [
        pa.field("click", pa.int8(), nullable=False),
        pa.field("request_id", pa.int64(), nullable=False),
        pa.field("user_id", pa.string()),
        pa.field("item_id", pa.string(), nullable=False),
        pa.field("recent_items", pa.list_(pa.string())),
        pa.field("price", pa.float32()),
        pa.field("discount", pa.float32()),
        pa.field("tags", pa.list_(pa.int64())),
        pa.field("tags_weight", pa.list_(pa.float32())),
    ]
)

# What the columns are, as a user would declare them for ``dlrmflow register``.
LOGS_SCHEMA = FeatureSchema(
    label="click",
    dense=(
        DenseFeature(column="price", transform="log"),
        DenseFeature(column="discount", transform="clip", clip_min=0.0, clip_max=1.0),
    ),
    sparse=(
        SparseFeature(column="user_id"),
        SparseFeature(column="item_id", table="items"),
        SparseFeature(column="recent_items", table="items"),
        SparseFeature(column="tags", weights="tags_weight"),
    ),
    keys=("request_id",),
)


@dataclass(frozen=True)
class _Table:
    """One ID column of the hidden model, indexed by popularity rank - 1."""

    cdf: np.ndarray  # float64 [n]: bounded-Zipf CDF over ranks
    effect: np.ndarray  # float64 [n]: logit effect per ID
    ids: pa.Array  # [n]: the ID each rank is logged as (string or int64)

    @property
    def cardinality(self) -> int:
        return self.cdf.size

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.searchsorted(self.cdf, rng.random(n), side="right")


@dataclass(frozen=True)
class _Truth:
    users: _Table
    items: _Table
    tags: _Table
    user_latent: np.ndarray  # float64 [users, LATENT_DIM]
    item_latent: np.ndarray  # float64 [items, LATENT_DIM]
    bias: float


@dataclass
class _Rows:
    """One chunk of generated columns and the (bias-free) true logits behind its clicks:
    with the tags' weights, and with every weight replaced by its mean (1)."""

    columns: dict[str, pa.Array]
    logit: np.ndarray
    logit_weights_ignored: np.ndarray


def generate_logs_dataset(
    config: DataConfig,
    url: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Write ``config.days`` days of synthetic logs, their manifest and statistics.

    The layout is ``URL/day=K/part-<name>.parquet`` (the name follows from the parameters
    and the day), row groups of ``config.row_group_size`` rows, then ``URL/manifest.json``
    declaring ``LOGS_SCHEMA`` and ``URL/stats.json``. The last day is the test day. As in
    ``ingest.synthetic``, a day already there under the same parameters is kept unread,
    the other days are written beside what is there, and the manifest is switched last
    (``publish_manifest``). ``progress(n)`` is called
    with the rows of each row group written. ``data.multi_hot`` and ``data.drift`` are
    the Criteo shape's and are refused here.
    """
    root = url if url is not None else config.url
    if not root:
        raise ConfigError("data.url: empty dataset URL")
    if config.seed < 0:
        raise ConfigError(f"data.seed must be >= 0 (got {config.seed})")
    if config.multi_hot:
        raise ConfigError("data.multi_hot: the logs shape's tags are always a list; unset it")
    if config.drift:
        raise ConfigError(f"data.drift: the logs shape has no drift (got {config.drift}); use 0")
    if config.churn:
        raise ConfigError(f"data.churn: the logs shape has no churn (got {config.churn}); use 0")
    if config.base_rate_step or config.weekly:
        raise ConfigError(
            "data.base_rate_step, data.weekly: the logs shape's click rate does not move; "
            "unset them"
        )
    with dataset_lock(root, "generate"):
        return _generate(config, root, progress)


def _generate(config: DataConfig, root: str, progress: Callable[[int], None] | None) -> Manifest:
    """``generate_logs_dataset``'s writing, under the dataset's lock
    (``generated.grow_days``)."""
    truth = _ground_truth(config)
    test_day = config.days - 1
    kept, ignored_auc = _kept_days(root, config)
    test = {"ignored_auc": ignored_auc}

    def write_day(day: int) -> DayFile:
        with day_file_writer(root, day, day_file_name(config, day), ARROW_SCHEMA) as writer:
            probs, labels, ignored = _write_day(writer, truth, config, day, progress)
            written = writer.finish()
        if day == test_day:
            test["ignored_auc"], _ = bayes_metrics(sigmoid(ignored + truth.bias), labels)
        return day_record(day, written, probs, labels, bayes_metrics)

    def manifest_of(files: list[DayFile], positives: int) -> Manifest:
        total_rows = config.rows_per_day * config.days
        return Manifest(
            source="synthetic",
            rows=total_rows,
            days=config.days,
            test_day=test_day,
            positive_rate=positives / total_rows,
            multi_hot=True,
            files=files,
            schema=schema_to_json(ARROW_SCHEMA),
            cardinalities={
                "user_id": truth.users.cardinality,
                "item_id": truth.items.cardinality,
                "recent_items": truth.items.cardinality,
                "tags": truth.tags.cardinality,
            },
            bayes_auc=files[test_day].bayes_auc,
            bayes_logloss=files[test_day].bayes_logloss,
            generator=_generator_record(config, truth, test["ignored_auc"]),
            features=LOGS_SCHEMA.to_dict(),
        )

    manifest = grow_days(root, config.days, kept, write_day, manifest_of, progress)
    # As registering a user's data does: the statistics the planner and transforms read.
    write_stats(root, dataset_stats(root, manifest))
    return manifest


def _kept_days(root: str, config: DataConfig) -> tuple[dict[int, DayFile], float | None]:
    """The days of the dataset at ``root`` that generating ``config`` would write again
    byte for byte (``generated.unchanged_days``; the test day only where it was the test
    day, which alone has ``auc_list_weights_ignored``), and that figure where the test day
    is kept; none where there is no readable manifest of this shape."""
    manifest, kept = unchanged_days(root, config.days, lambda day: day_file_name(config, day))
    if manifest is None or (manifest.generator or {}).get("shape") != SHAPE:
        return {}, None
    test_day = config.days - 1
    if manifest.test_day != test_day:
        kept.pop(test_day, None)  # written again for its auc_list_weights_ignored
    return kept, manifest.generator.get("auc_list_weights_ignored") if test_day in kept else None


def day_file_name(config: DataConfig, day: int) -> str:
    """Day ``day``'s file name: a hash of everything its bytes follow from (see
    ``ingest.synthetic.day_file_name``), the shape included, so that the two shapes'
    files never share a name."""
    parameters = config.model_dump(
        mode="json",
        # The Criteo shape's settings (refused here) leave the names as they were.
        exclude={
            "url",
            "days",
            "train_days",
            "eval_days",
            "landing",
            "multi_hot",
            "drift",
            "churn",
            "base_rate_step",
            "weekly",
        },
    )
    versions = (SHAPE, GENERATOR_FORMAT, np.__version__, pa.__version__)
    return file_name("synthetic", *versions, sorted(parameters.items()), day)


def _write_day(
    writer: DayFileWriter,
    truth: _Truth,
    config: DataConfig,
    day: int,
    progress: Callable[[int], None] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Write one day, a row group at a time: its true probabilities, labels and logits with
    the tags' weights ignored (kept for the day's metrics: 17 bytes a row)."""
    probs_kept, labels_kept, ignored_kept = [], [], []
    for chunk, start in enumerate(range(0, config.rows_per_day, config.row_group_size)):
        n = min(config.row_group_size, config.rows_per_day - start)
        rng = seeded_rng(_SHAPE_KEY, _STREAM_ROWS, config.seed, day, chunk)
        rows = _sample_rows(truth, rng, n)
        probs = sigmoid(rows.logit + truth.bias)
        labels = (rng.random(n) < probs).astype(np.int8)
        request_ids = (day << 32) + start + np.arange(n, dtype=np.int64)
        columns = {"click": pa.array(labels), "request_id": pa.array(request_ids), **rows.columns}
        writer.write_table(pa.table(columns, schema=ARROW_SCHEMA), row_group_size=n)
        probs_kept.append(probs)
        labels_kept.append(labels)
        ignored_kept.append(rows.logit_weights_ignored)
        if progress is not None:
            progress(n)
    return (
        np.concatenate(probs_kept),
        np.concatenate(labels_kept),
        np.concatenate(ignored_kept),
    )


def _cardinality(base: int, config: DataConfig) -> int:
    return int(min(max(round(base * config.cardinality_scale), 2), config.max_cardinality))


def _table(
    rng: np.random.Generator, n: int, effect_std: float, ids: Callable[[np.ndarray], pa.Array]
) -> _Table:
    """An ID table of ``n`` ranks: Zipf popularity, effects that shrink with the rank, and
    the IDs ``ids`` makes of each rank's scattered number (so that no ID tells its rank)."""
    ranks = np.arange(1, n + 1, dtype=np.float64)
    cdf = np.cumsum(ranks**-ZIPF_EXPONENT)
    cdf /= cdf[-1]
    cdf[-1] = 1.0  # searchsorted of u < 1 must never run past the last rank
    effect = rng.normal(0.0, effect_std, n) * ranks**-RANK_DECAY
    key = np.uint32(rng.integers(0, 1 << 32))
    return _Table(cdf, effect, ids(hashed_ids(np.arange(n), key)))


def _ground_truth(config: DataConfig) -> _Truth:
    """The hidden click model: the three ID tables, the latent vectors and the bias."""
    rng = seeded_rng(_SHAPE_KEY, _STREAM_TABLES, config.seed)
    users = _table(
        rng,
        _cardinality(USERS, config),
        USER_EFFECT_STD,
        lambda ids: pa.array([f"u{i:08x}" for i in ids.tolist()], pa.string()),
    )
    items = _table(
        rng,
        _cardinality(ITEMS, config),
        ITEM_EFFECT_STD,
        lambda ids: pa.array([f"item-{i}" for i in ids.tolist()], pa.string()),
    )
    tags = _table(rng, _cardinality(TAGS, config), TAG_EFFECT_STD, pa.array)
    latents = []
    for table in (users, items):
        scale = np.arange(1, table.cardinality + 1, dtype=np.float64) ** -RANK_DECAY
        latents.append(
            rng.normal(0.0, LATENT_STD, (table.cardinality, LATENT_DIM)) * scale[:, None]
        )
    truth = _Truth(users, items, tags, latents[0], latents[1], bias=0.0)
    calibration = _sample_rows(
        truth, seeded_rng(_SHAPE_KEY, _STREAM_CALIBRATION, config.seed), CALIBRATION_ROWS
    )
    bias = calibrate_bias(calibration.logit, config.positive_rate)
    return _Truth(users, items, tags, truth.user_latent, truth.item_latent, bias)


def _sample_rows(truth: _Truth, rng: np.random.Generator, n: int) -> _Rows:
    """Draw ``n`` rows of feature columns and their true logits (without the bias)."""
    user = truth.users.draw(rng, n)
    present = rng.random(n) >= USER_MISSING
    item = truth.items.draw(rng, n)
    interaction = np.einsum("nd,nd->n", truth.user_latent[user], truth.item_latent[item])
    logit = (truth.users.effect[user] + interaction) * present + truth.items.effect[item]

    # Price: log-normal; the model sees log(1 + price) with nulls as 0.
    price = np.exp(math.log(PRICE_MEDIAN) + PRICE_SIGMA * rng.standard_normal(n))
    price = price.astype(np.float32)
    price_missing = rng.random(n) < PRICE_MISSING
    logit += PRICE_WEIGHT * np.log1p(np.where(price_missing, 0.0, price.astype(np.float64)))

    # Discount: the share taken off; a few logged as -1 or as a percent; clipped to [0, 1].
    discount = np.clip(DISCOUNT_MEAN + DISCOUNT_STD * rng.standard_normal(n), 0.0, 0.9)
    errors = rng.random(n) < DISCOUNT_ERRORS
    discount[errors] = np.where(rng.random(int(errors.sum())) < 0.5, -1.0, 100.0)
    discount = discount.astype(np.float32)
    discount_missing = rng.random(n) < DISCOUNT_MISSING
    seen = np.clip(np.where(discount_missing, 0.0, discount.astype(np.float64)), 0.0, 1.0)
    logit += DISCOUNT_WEIGHT * seen

    # Tags: a list of IDs, each with a weight; the logit takes their weighted sum of effects.
    lengths, offsets = _list_lengths(rng, n, TAGS_MEAN_LENGTH, TAGS_MISSING)
    tag = truth.tags.draw(rng, int(lengths.sum()))
    sigma = TAG_WEIGHT_SIGMA
    weight = np.exp(sigma * rng.standard_normal(tag.size) - 0.5 * sigma * sigma)
    weight = weight.astype(np.float32)
    row = np.repeat(np.arange(n), lengths)
    effect = truth.tags.effect[tag]
    logit_ignored = logit + np.bincount(row, effect, minlength=n)
    logit += np.bincount(row, effect * weight.astype(np.float64), minlength=n)

    # Recent items: a list of item IDs from item_id's popularity; the logit takes
    # RECENT_WEIGHT times the sum of their item effects (none for a null or empty list).
    recent_lengths, recent_offsets = _list_lengths(rng, n, RECENT_MEAN_LENGTH, RECENT_MISSING)
    recent = truth.items.draw(rng, int(recent_lengths.sum()))
    recent_row = np.repeat(np.arange(n), recent_lengths)
    recent_term = RECENT_WEIGHT * np.bincount(recent_row, truth.items.effect[recent], minlength=n)
    logit += recent_term
    logit_ignored += recent_term

    columns = {
        "user_id": pc.take(truth.users.ids, pa.array(user, mask=~present)),
        "item_id": pc.take(truth.items.ids, pa.array(item)),
        "recent_items": pa.ListArray.from_arrays(
            recent_offsets, pc.take(truth.items.ids, pa.array(recent))
        ),
        "price": pa.array(price, mask=price_missing),
        "discount": pa.array(discount, mask=discount_missing),
        "tags": pa.ListArray.from_arrays(offsets, pc.take(truth.tags.ids, pa.array(tag))),
        "tags_weight": pa.ListArray.from_arrays(offsets, pa.array(weight)),
    }
    return _Rows(columns, logit, logit_ignored)


def _list_lengths(
    rng: np.random.Generator, n: int, mean_length: float, missing: float
) -> tuple[np.ndarray, pa.Array]:
    """``n`` lists' lengths (Poisson of mean ``mean_length``; 0 for the share ``missing``
    of null lists) and their Arrow offsets, null where the list is."""
    null_list = rng.random(n) < missing
    lengths = rng.poisson(mean_length, n) * ~null_list
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return lengths, pa.array(offsets, mask=np.append(null_list, False))


def _generator_record(
    config: DataConfig, truth: _Truth, ignored_auc: float | None
) -> dict[str, object]:
    """Everything needed to tell two generated datasets apart, and what the weights are
    worth, for the manifest."""
    return {
        "shape": SHAPE,
        "seed": config.seed,
        "numpy": np.__version__,
        "rows_per_day": config.rows_per_day,
        "row_group_size": config.row_group_size,
        "cardinality_scale": config.cardinality_scale,
        "max_cardinality": config.max_cardinality,
        "target_positive_rate": config.positive_rate,
        "zipf_exponent": ZIPF_EXPONENT,
        "rank_decay": RANK_DECAY,
        "effect_std": {
            "user_id": USER_EFFECT_STD,
            "item_id": ITEM_EFFECT_STD,
            "tags": TAG_EFFECT_STD,
        },
        "latent_dim": LATENT_DIM,
        "latent_std": LATENT_STD,
        "tags_mean_length": TAGS_MEAN_LENGTH,
        "recent_mean_length": RECENT_MEAN_LENGTH,
        "recent_weight": RECENT_WEIGHT,
        "tag_weight_sigma": TAG_WEIGHT_SIGMA,
        "price_weight": PRICE_WEIGHT,
        "discount_weight": DISCOUNT_WEIGHT,
        "calibration_rows": CALIBRATION_ROWS,
        "bias": truth.bias,
        # The test day's AUC of the true model with every tag weight replaced by its mean:
        # about the best a model that pools the tags without their weights can reach.
        "auc_list_weights_ignored": ignored_auc,
    }
