"""The dense layers' optimizer (``train.dense_optimizer``): Adam by default, Adagrad or SGD
when chosen, or the embeddings' (``train.optimizer``) when null; its state is checkpointed
with the model, so a resumed run ends bitwise where the uninterrupted run ends."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from dlrmflow.config import RunConfig, recorded_config
from dlrmflow.train.run.checkpoint import list_checkpoints, load_checkpoint, model_state
from dlrmflow.train.run.resume import IncompatibleCheckpoint
from dlrmflow.train.run.trainer import dense_optimizer, train
from tests.conftest import same_weights, tiny_run_config


def test_the_default_is_adam_and_null_follows_the_embeddings_optimizer() -> None:
    params = [nn.Parameter(torch.ones(3))]
    assert isinstance(dense_optimizer(params, RunConfig()), torch.optim.Adam)
    for embeddings, expected in (("adagrad", torch.optim.Adagrad), ("sgd", torch.optim.SGD)):
        config = RunConfig.model_validate(
            {"train": {"optimizer": embeddings, "dense_optimizer": None}}
        )
        assert type(dense_optimizer(params, config)) is expected
    chosen = RunConfig.model_validate({"train": {"dense_optimizer": "sgd"}})
    assert type(dense_optimizer(params, chosen)) is torch.optim.SGD


def test_a_configuration_recorded_before_the_key_trained_its_dense_layers_as_its_embeddings():
    recorded = RunConfig().model_dump()
    del recorded["train"]["dense_optimizer"]
    assert recorded_config(recorded).train.dense_optimizer is None


def test_adams_state_made_before_the_first_step_trains_bitwise_as_torchs_own() -> None:
    """The state exists from the start (a checkpoint loads into it in place) and changes
    nothing: the same steps give bitwise torch's lazily initialized Adam's weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 1))
    twin = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 1))
    twin.load_state_dict(model.state_dict())
    ours = dense_optimizer(list(model.parameters()), RunConfig())
    assert all(len(ours.state[p]) == 3 for p in model.parameters())
    torchs = torch.optim.Adam(twin.parameters(), lr=RunConfig().train.lr)
    for step in range(5):
        x = torch.randn(16, 5, generator=torch.Generator().manual_seed(step))
        for m, opt in ((model, ours), (twin, torchs)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ours.state[p][key], torchs.state[q][key]), key


STATE = {"adam": {"step", "exp_avg", "exp_avg_sq"}, "adagrad": {"step", "sum"}, "sgd": set()}


@pytest.mark.parametrize("kind", ["adam", "adagrad", "sgd"])
def test_a_run_killed_after_a_checkpoint_resumes_bitwise_under_each_dense_optimizer(
    tiny_dataset: str, tmp_path: Path, kind: str
) -> None:
    whole = tiny_run_config(tiny_dataset, tmp_path / "whole", max_steps=8, dense_optimizer=kind)
    train(whole)
    killed = whole.model_copy(deep=True)
    killed.run_dir = str(tmp_path / "killed")
    killed.train.checkpoint_every = 3
    killed.train.keep_checkpoints = 10
    train(killed)
    for c in list_checkpoints(killed.run_dir):
        if c.step > 3:
            shutil.rmtree(c.path)
    (Path(killed.run_dir) / "train_result.json").unlink()
    resumed = train(killed)
    assert (resumed.resumed_from_step, resumed.steps) == (3, 8)
    same_weights(killed.run_dir, whole.run_dir)
    # What the checkpoint carried besides the weights: the optimizer's state per parameter.
    loaded = load_checkpoint(whole.run_dir)
    optimizer = dense_optimizer(list(loaded.model.dense_arch.parameters()), whole)
    keys = {k.rsplit(".", 1)[1] for k in model_state(loaded.model, optimizer) if "optim" in k}
    assert keys == STATE[kind]


def test_fine_tuning_under_another_dense_optimizer_is_refused_naming_the_key(
    tiny_dataset: str, tmp_path: Path
) -> None:
    source = tiny_run_config(tiny_dataset, tmp_path / "source", max_steps=2)
    train(source)
    tuned = tiny_run_config(
        tiny_dataset,
        tmp_path / "tuned",
        max_steps=4,
        dense_optimizer="adagrad",
        resume=str(list_checkpoints(source.run_dir)[-1].path),
    )
    with pytest.raises(IncompatibleCheckpoint, match="train.dense_optimizer 'adam' -> 'adagrad'"):
        train(tuned)
