"""The real Snakefile with hostile paths: a raw file name that is a shell injection, spaces in the results
directory, the input directory and the model directory; a user's model directory beside the demo (never a job's
output); and a misspelled config key that must be an error."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from workflow_runs import make_workdir, planned_outputs, snakemake

HOSTILE = "x$(touch PWNED) `touch PWNED2`; y.jsonl"


@pytest.mark.slow
def test_hostile_file_names_reach_the_gate_unharmed(tmp_path, tiny_target, demo_raw):
    work = make_workdir(tmp_path / "run dir")
    raw = work / "raw data"
    raw.mkdir()
    # the demo's JSON array as JSONL, under a name that runs `touch` if a rule passes it to the shell unquoted
    records = json.loads((demo_raw / "sharegpt_part1_cleaned_split.json").read_text())
    (raw / HOSTILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    # the user's model, not the demo's: demo.enabled stays true (config/config.yaml), the model is given with
    # --config as a user would, and a file the demo's tiny model has (demo_target.json) is missing from it
    model = work / "my model"
    shutil.copytree(tiny_target, model)
    (model / "demo_target.json").unlink()
    model_bytes = {p.name: p.read_bytes() for p in model.iterdir()}
    cfg = {"results": "my results", "inputs": ["raw data/*.jsonl"], "generate": {"enabled": False}}
    (work / "hostile.yaml").write_text(yaml.safe_dump(cfg))
    args = ("my results/audit/source/report.json", "--config", "target={model_path: my model}")
    dry = snakemake(work, "-n", *args, configfiles=("hostile.yaml",))
    outputs = planned_outputs(dry)
    assert outputs and not [o for o in outputs if o.startswith("my model")], outputs
    proc = snakemake(work, "--cores", "2", *args, configfiles=("hostile.yaml",), check=False)
    out = proc.stdout + proc.stderr
    assert not list(tmp_path.rglob("PWNED*")), "a file name was executed by the shell"
    assert proc.returncode == 0, out[-6000:]
    assert {p.name: p.read_bytes() for p in model.iterdir()} == model_bytes, "the user's model directory changed"
    report = json.loads((work / "my results/audit/source/report.json").read_text())
    files = report["ingest"]["files"]
    assert len(files) == 1
    f = files[0]
    assert f["records_read"] == len(records) == f["kept"] + f["quarantined"] + f["duplicates"]
    assert f["kept"] > 0


def test_misspelled_config_keys_are_errors(tmp_path):
    work = make_workdir(tmp_path / "w")
    for bad, key in (({"trian": {"epochs": 1}}, "trian"), ({"target": {"model_path": "m", "trust_remote": True}},
                                                            "trust_remote"), ({"demo": {"record": 5}}, "record")):
        (work / "bad.yaml").write_text(yaml.safe_dump(bad))
        proc = snakemake(work, "-n", configfiles=("tiny.yaml", "bad.yaml"), check=False)
        assert proc.returncode != 0
        out = proc.stdout + proc.stderr
        # one line naming the key and its closest known name, not the error followed by the whole schema
        (line,) = [line for line in out.splitlines() if f"'{key}' was unexpected" in line]
        assert "did you mean" in line and "properties" not in out.replace(line, ""), out[-3000:]
        assert len(out.splitlines()) < 10, out
