"""`dlrmflow demo --quick`: the end-to-end flow on the local ephemeral API, as a user runs it,
and the configuration the demo gives it.

Its tasks and artifacts are checked on a real server in test_server.py."""

import json
import subprocess
import sys

from dlrmflow.config import build_config
from tests.prefect_server import new_prefect_home, server_env

SUMMARY_KEYS = {
    "auc", "logloss", "ne", "calibration", "bayes_auc", "bayes_logloss", "rows_trained",
    "train_samples_per_s", "ingest_rows_per_s", "steps", "world_size", "checkpoint",
}  # fmt: skip


def test_demo_quick_command(tmp_path, pytestconfig):
    env = server_env(new_prefect_home(tmp_path / "prefect", pytestconfig))
    run_dir = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "dlrmflow", "demo", "--quick", "--run-dir", str(run_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary.keys() >= SUMMARY_KEYS
    assert summary["auc"] > 0.6
    # Sharded over two ranks by default, every training row trained once.
    assert summary["world_size"] == 2
    assert summary["rows_trained"] == 2 * 20_000
    assert "auc" in proc.stdout and str(run_dir / "summary.json") in proc.stdout


def test_the_demo_splits_its_global_batch_over_its_ranks_and_keeps_its_data_beside_it():
    # Imported here: Prefect, imported while collecting, would read its settings before
    # other tests of the session set PREFECT_API_URL.
    from dlrmflow.flows.end_to_end import DEMO_IDS, DEMO_RANKS, QUICK, demo_config

    chosen = build_config({})
    cfg = demo_config(chosen, "runs/d")
    assert (cfg.run_dir, cfg.data.url) == ("runs/d", "runs/d/data")
    assert cfg.distributed.nproc == DEMO_RANKS == 2
    assert cfg.features.ids == DEMO_IDS == "vocab" != chosen.features.ids
    assert cfg.train.batch_size == chosen.train.batch_size // DEMO_RANKS
    assert cfg.data.days == chosen.data.days  # not --quick: the configuration's data

    quick = demo_config(chosen, "runs/d", quick=True)
    assert (quick.data.days, quick.data.rows_per_day) == (QUICK["data.days"], 20_000)
    assert quick.train.batch_size == QUICK["train.batch_size"] // DEMO_RANKS


def test_what_the_user_chose_is_kept_by_the_demo():
    # Imported here: Prefect, imported while collecting, would read its settings before
    # other tests of the session set PREFECT_API_URL.
    from dlrmflow.flows.end_to_end import DEMO_RANKS, QUICK, demo_config

    chosen = build_config({"data": {"url": "/data/criteo"}, "distributed": {"nproc": 3}})
    cfg = demo_config(chosen, "runs/d", quick=True)
    assert (cfg.data.url, cfg.distributed.nproc) == ("/data/criteo", 3)
    assert cfg.train.batch_size == QUICK["train.batch_size"] // 3  # the global batch, split
    own_batch = demo_config(build_config({"train": {"batch_size": 300}}), "runs/d")
    assert (own_batch.train.batch_size, own_batch.distributed.nproc) == (300, DEMO_RANKS)
    one = demo_config(build_config({"distributed": {"nproc": 1}}), "runs/d")
    assert one.train.batch_size == build_config({}).train.batch_size
    hashed = demo_config(build_config({"features": {"ids": "hash"}}), "runs/d")
    assert hashed.features.ids == "hash"
