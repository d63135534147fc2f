"""Issue 27, item 16: what used to be a traceback is one line naming the path and the reason, before any work where
it can be known before: train's --checkpoint-dir or --out naming a file, a full disk (a real file-size limit:
RLIMIT_FSIZE makes the kernel refuse the write, EFBIG) while train writes its checkpoint or export its weights,
generate --backend hf on a target without a chat template, and reset --yes on a symlinked checkpoint directory."""

from __future__ import annotations

import resource
import shutil
import subprocess

from conftest import BIN, run_cli
from test_train import _train_args, token_shards  # noqa: F401 - the module fixture

from dflash_pipeline.drafter.config import DrafterConfig
from dflash_pipeline.drafter.model import DFlashDrafter, save_drafter
from dflash_pipeline.target import read_config


def _cli_limited(args, fsize: int) -> subprocess.CompletedProcess:
    """`dflash-pipeline ARGS` with files limited to `fsize` bytes (Python ignores SIGXFSZ: the write fails)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    return subprocess.run([str(BIN / "dflash-pipeline"), *map(str, args)], capture_output=True, text=True,
                          preexec_fn=limit, timeout=300)


def _one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    for needle in needles:
        assert needle in line, line
    return line


def test_train_refuses_a_file_as_checkpoint_dir_or_out_before_any_work(tiny_target, token_shards, tmp_path):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    for ckpt, out, option in ((afile, tmp_path / "out", "--checkpoint-dir"), (tmp_path / "ck", afile, "--out"),
                              (tmp_path / "ck", afile / "sub", "--out")):
        proc = run_cli(*_train_args(tiny_target, token_shards, out, ckpt), check=False)
        line = _one_line(proc, f"train: {option} ", str(afile))
        assert "is a file" in line
        assert not (tmp_path / "ck").exists()  # refused before the checkpoint directory was made


def test_train_on_a_full_disk_names_the_checkpoint(tiny_target, token_shards, tmp_path):
    proc = _cli_limited(_train_args(tiny_target, token_shards, tmp_path / "out", tmp_path / "ck"), 40_000)
    line = _one_line(proc, f"train: writing {tmp_path / 'ck'} failed", "the file could not be written completely",
                     "make room, then rerun: training resumes")
    assert "unexpected pos" in line  # torch's own words, kept as the detail


def _drafter_dir(tiny_target, root):
    tc = read_config(tiny_target)  # its vocabulary rows: the drafter's head must match them
    cfg = DrafterConfig.from_target(tc, 2, [1, 4, 6], 16, 1343, tc["vocab_size"])
    out = root / "drafter"
    out.mkdir()
    save_drafter(out, DFlashDrafter(cfg))
    return out


def test_export_on_a_full_disk_or_into_a_file_is_one_line(tiny_target, tmp_path):
    drafter = _drafter_dir(tiny_target, tmp_path)
    args = ["export", "--drafter", drafter, "--model", tiny_target, "--out", tmp_path / "export"]
    _one_line(_cli_limited(args, 40_000), f"export: writing {tmp_path / 'export'} failed: safetensors:",
              "File too large", "make room, then rerun")
    assert not (tmp_path / "export").exists()
    (tmp_path / "file").write_text("x")
    args[-1] = tmp_path / "file"
    _one_line(run_cli(*args, check=False), f"export: --out {tmp_path / 'file'}: is a file")


def test_generate_hf_on_a_target_without_a_chat_template_is_one_line(tiny_target, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_target, model)
    (model / "chat_template.jinja").unlink()
    proc = run_cli("generate", "--backend", "hf", "--model", model, "--input", tmp_path / "in.parquet",
                   "--out", tmp_path / "out.parquet", check=False)
    _one_line(proc, f"generate --model {model}: the target has no chat template")


def test_reset_yes_with_a_symlinked_checkpoint_directory_empties_it_and_keeps_the_link(tmp_path):
    elsewhere = tmp_path / "big-disk" / "ckpt"
    (elsewhere / "sub").mkdir(parents=True)
    (elsewhere / "step-00000003.pt").write_bytes(b"x" * 100)
    (elsewhere / "sub" / "f").write_text("y")
    (tmp_path / "results" / "train").mkdir(parents=True)
    (tmp_path / "results" / "train" / "checkpoints").symlink_to(elsewhere)
    proc = run_cli("reset", "train", "--results", tmp_path / "results", "--yes")
    assert "links to" in proc.stdout and "the link is kept" in proc.stdout, proc.stdout
    assert (tmp_path / "results" / "train" / "checkpoints").is_symlink() and list(elsewhere.iterdir()) == []
