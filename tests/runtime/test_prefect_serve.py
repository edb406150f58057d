"""Prefect's serve message (``runtime.prefect_serve``): its own where the private helper is
as written against, one line naming the deployments where it has moved."""

from __future__ import annotations

from types import SimpleNamespace

from prefect import flows

from dlrmflow.runtime.prefect_serve import display_serve_start_message


def test_the_installed_prefect_prints_its_own_message(monkeypatch):
    shown = []
    assert callable(getattr(flows, "_display_serve_start_message", None)), (
        "prefect.flows._display_serve_start_message has moved: runtime.prefect_serve falls back"
    )
    monkeypatch.setattr(flows, "_display_serve_start_message", lambda *d: shown.append(d))
    deployment = SimpleNamespace(name="train")
    assert display_serve_start_message([deployment]) is True
    assert shown == [(deployment,)]


def test_without_the_helper_one_line_names_the_deployments(monkeypatch, capsys):
    monkeypatch.delattr(flows, "_display_serve_start_message")
    names = [SimpleNamespace(name="train"), SimpleNamespace(name="evaluate")]
    assert display_serve_start_message(names) is False
    assert capsys.readouterr().err == "serving deployments: train, evaluate\n"
