"""benchmarks/peer_file_write.py: SpecForge-shaped files written from 1..N threads, side by side, into a folder it
leaves empty; each row's size is what torch.save wrote."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import peer_file_write  # noqa: E402


def test_the_write_benchmark_prints_a_row_per_thread_count(tmp_path, capsys):
    d = tmp_path / "w"
    rows = peer_file_write.main(["--dir", str(d), "--files", "3", "--tokens", "16", "--width", "32",
                                 "--raw-gb", "0.01", "--threads", "1", "3"])
    out = capsys.readouterr().out
    assert [r[0] for r in rows] == ["raw sequential write + fsync", "torch.save, 1 thread(s)", "torch.save, 3 thread(s)"]
    assert all(rate > 0 for _, _, rate in rows) and not d.exists()
    # 16 tokens x 32 bf16 features + two int64 vectors of 16, and the pickle around them: a few KB a file
    assert rows[1][1] == rows[2][1] and rows[1][1].startswith("3 x 0.00")
    assert "torch.save, 3 thread(s)" in out and "vs 1 thread" in out
