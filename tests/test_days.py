"""Day windows (``data.train_days``, ``data.eval_days``): what each form selects, and the
one-line errors naming the key and the day."""

from __future__ import annotations

import pytest

from dlrmflow.config import ConfigError, load_config
from dlrmflow.days import WindowError, describe, held_out_days, select_days, windows

DAYS = [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("window", "selected"),
    [
        ("0-2", [0, 1, 2]),
        ("0-1, 4", [0, 1, 4]),
        ("3", [3]),
        ([5, 0], [0, 5]),
        ("all", DAYS),
        ("first 2", [0, 1]),
        ("last", [5]),
        ("last 2", [4, 5]),
        ("all_but_last", [0, 1, 2, 3, 4]),
        ("all_but_last 3", [0, 1, 2]),
        ("first 2, last", [0, 1, 5]),
        ("last 10", DAYS),  # a relative form takes what the dataset has
    ],
)
def test_each_form_selects_its_days(window, selected):
    assert select_days(window, DAYS, "data.train_days") == selected


@pytest.mark.parametrize(
    ("window", "message"),
    [
        ("0-9", "data.train_days: day 6: not in the dataset (its days: 0-5)"),
        ([7], "data.train_days: day 7: not in the dataset"),
        ("all_but_last 6", "data.train_days: 'all_but_last 6' selects no day of the dataset"),
        ("2-1", "a range runs from its lower day up"),
        ("yesterday", "'yesterday' is not a day window"),
        ("all 3", "'all' takes no count"),
        ("last 0", "the count must be at least 1"),
        ([], "an empty list selects no day"),
    ],
)
def test_a_bad_window_is_one_line_naming_the_key(window, message):
    with pytest.raises(WindowError) as caught:
        select_days(window, DAYS, "data.train_days")
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_unset_windows_are_the_test_day_and_every_other_day():
    assert windows(None, None, DAYS, 5) == ([0, 1, 2, 3, 4], [5])
    assert windows("0-2", "4", DAYS, 5) == ([0, 1, 2], [4])
    assert windows(None, "2", DAYS, 5) == ([0, 1, 3, 4, 5], [2])


def test_a_day_trained_and_held_out_is_refused():
    with pytest.raises(WindowError, match="data.train_days: day 4 is also in data.eval_days"):
        windows("0-4", "last 2", DAYS, 5)
    with pytest.raises(WindowError, match="data.eval_days: day 2: the model trained on it"):
        held_out_days("2-3", DAYS, 5, trained=[0, 1, 2])
    with pytest.raises(WindowError, match="every day of the dataset is held out"):
        windows(None, "all", DAYS, 5)
    with pytest.raises(WindowError, match="test day 6 has no file"):
        windows(None, None, DAYS, 6)


def test_the_configuration_checks_a_windows_form_and_reads_one_day_as_a_list():
    config = load_config(None, ["data.train_days=0-3", "data.eval_days=5"])
    assert (config.data.train_days, config.data.eval_days) == ("0-3", [5])
    assert load_config(None, []).data.train_days is None
    with pytest.raises(ConfigError, match="data.train_days.*'monday' is not a day window"):
        load_config(None, ["data.train_days=monday"])
    with pytest.raises(ConfigError, match="data.eval_days.*-1 is not a day"):
        load_config(None, ["data.eval_days=[-1]"])


def test_days_are_described_as_ranges():
    assert describe([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert describe([]) == "none"


def test_none_holds_no_day_out_and_trains_on_every_day():
    assert windows(None, "none", DAYS, 5) == (DAYS, [])
    assert held_out_days("none", DAYS, 5) == []
    with pytest.raises(WindowError, match="data.train_days: 'none' selects no day"):
        select_days("none", DAYS, "data.train_days")
