"""The compile job id that lets separate processes of one workload share torch.compile's dynamic-shape profile."""

import pytest
import torch

from dflash_pipeline import compile_profile


@pytest.fixture(autouse=True)
def _keep_job_id():
    """torch's config module is process-wide: each test leaves the job id as it found it."""
    old = torch.compiler.config.job_id
    yield
    torch.compiler.config.job_id = old


def _reset(monkeypatch, value=None):
    torch.compiler.config.job_id = value
    monkeypatch.setattr(compile_profile, "_NAMED_HERE", set())


def test_same_workload_same_name_in_another_process_shape(monkeypatch):
    _reset(monkeypatch)
    first = compile_profile.name_compiled_workload("train", {"hidden": 576, "layout": "packed"})
    _reset(monkeypatch)
    again = compile_profile.name_compiled_workload("train", {"layout": "packed", "hidden": 576})
    assert first == again and first.startswith("dflash-train-")
    _reset(monkeypatch)
    other = compile_profile.name_compiled_workload("train", {"hidden": 960, "layout": "packed"})
    assert other != first


def test_next_stage_in_one_process_takes_its_own_name(monkeypatch):
    _reset(monkeypatch)
    extract = compile_profile.name_compiled_workload("extract", {"layers": [1, 2]})
    train = compile_profile.name_compiled_workload("train", {"hidden": 576})
    assert extract.startswith("dflash-extract-") and train.startswith("dflash-train-")
    assert torch.compiler.config.job_id == train


def test_a_job_id_set_by_the_user_wins(monkeypatch):
    _reset(monkeypatch, "my-run-7")
    assert compile_profile.name_compiled_workload("train", {"hidden": 576}) == "my-run-7"
    assert torch.compiler.config.job_id == "my-run-7"


def test_training_names_its_workload_by_typed_train_settings():
    """The GPU-only code that names training's workload reads these settings: each must be one (CPU check)."""
    import argparse
    import dataclasses

    from dflash_pipeline.drafter import train
    from dflash_pipeline.settings import typed

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    fields = {f.name for f in dataclasses.fields(typed.stage_class("train", frozenset(
        a.dest for a in parser._actions if a.dest != "help")))}
    assert set(train.SHAPE_SETTINGS) <= fields, set(train.SHAPE_SETTINGS) - fields
