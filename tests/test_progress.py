"""Long stages report progress while they work: one line per interval with done/total, elapsed, rate and ETA."""

from __future__ import annotations

import logging

from dflash_pipeline.progress import Progress, duration


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_one_line_per_interval_with_elapsed_and_eta(caplog):
    clock = Clock()
    log = logging.getLogger("test.progress")
    progress = Progress("train", 400, "steps", log, start=100, interval_s=30, clock=clock)
    with caplog.at_level("INFO", logger="test.progress"):
        for _ in range(100):  # 100 steps at 2 s each: a line at 30, 60, ... s, none in between
            clock.t += 2
            progress.update()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 6, lines
    # resumed at step 100: the rate counts this run's 15 steps in 30 s, not the 115 done
    assert lines[0] == "train: 115/400 steps (28.8%), elapsed 30 s, 0.5 steps/s, ETA 9 min 30 s"
    assert lines[-1] == "train: 190/400 steps (47.5%), elapsed 3 min 00 s, 0.5 steps/s, ETA 7 min 00 s"


def test_duration():
    assert [duration(s) for s in (None, 5, 185, 7620)] == ["?", "5 s", "3 min 05 s", "2 h 07 min"]


def test_tokenize_reports_progress_across_its_shards(tmp_path, tiny_target, monkeypatch, caplog):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_pipeline.cli import main
    from dflash_pipeline.data.conversations import SAMPLE_SCHEMA, sample_id

    inputs = []
    for s in range(2):
        convs = [[{"role": "user", "content": f"Q {s} {i}", "reasoning_content": None},
                  {"role": "assistant", "content": f"Answer {i}.", "reasoning_content": None}] for i in range(30)]
        rows = [{"sample_id": sample_id(m), "source": f"t#{i}", "source_id": None, "messages": m}
                for i, m in enumerate(convs)]
        inputs.append(str(tmp_path / f"s{s}.parquet"))
        pq.write_table(pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA), inputs[-1])
    monkeypatch.setenv("DFLASH_PROGRESS_INTERVAL_S", "0")
    with caplog.at_level("INFO", logger="dflash_pipeline.data.tokenize"):
        assert main(["tokenize", "--input", *inputs, "--model", str(tiny_target), "--out-dir", str(tmp_path / "t"),
                     "--batch-size", "10"]) == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tokenize (2 shards): ")]
    assert [ln.split(" samples")[0].split(": ")[1] for ln in lines] == [f"{n}/60" for n in range(10, 61, 10)] + ["60/60"]
    assert all("elapsed" in ln and "ETA" in ln for ln in lines)
