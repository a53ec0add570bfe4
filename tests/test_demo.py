"""``grain-core demo`` end to end, at small sizes: every format, worker counts, the resume check."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from grain_core import cli, demo

pytest.importorskip("jax")

SMALL = ["--records", "600", "--steps", "6", "--checkpoint-step", "2"]
TIMEOUT_S = 300  # two processes import JAX and start workers; generous for loaded CI machines


def _run_demo(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = dict(os.environ, JAX_PLATFORMS="cpu", **env)
    return subprocess.run(
        [sys.executable, "-m", "grain_core", "demo", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=environment,
    )


@pytest.mark.parametrize(
    ("fmt", "workers", "suffix"),
    [
        ("arrayrecord", "2", ".array_record"),
        ("parquet", "1", ".parquet"),
        ("tfrecord", "0", ".tfrecord"),
    ],
)
def test_demo_trains_checkpoints_and_resumes_bit_exactly(
    fmt: str, workers: str, suffix: str
) -> None:
    pytest.importorskip(f"grain_{fmt}")
    done = _run_demo("--format", fmt, "--workers", workers, *SMALL)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert f"images{suffix} ({fmt}," in out
    assert f"DataLoader({workers} workers)" in out
    assert "images/s" in out and "waiting for batches" in out
    assert "grain_core execution summary" in out
    assert "resume:   OK: steps 3-6 after the restart read the same 4 batches" in out
    assert "Traceback" not in done.stderr
    assert max(len(line) for line in out.splitlines()) <= 100
    # A word on why the loop waits: the step against the loader's time per batch.
    flat = " ".join(out.split())
    assert "The loop waits because this small model's step" in flat or (
        "A step (" in flat and "the wait is the first batch" in flat
    )


def test_demo_without_the_format_plugin_reads_in_memory_records() -> None:
    done = _run_demo("--workers", "0", *SMALL, GRAIN_CORE_DISABLE_PLUGINS="arrayrecord")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "note: the arrayrecord format plugin is not installed" in done.stdout
    assert "pip install . ./plugins/grain_arrayrecord (in a clone of grain_core)" in done.stdout
    assert "resume:   OK" in done.stdout


def test_resume_check_fails_loudly(capsys: pytest.CaptureFixture[str]) -> None:
    digests, losses = ["a", "b", "c", "d"], [2.0, 1.5, 1.25, 1.0]
    same = {"digests": ["c", "d"], "losses": [1.25, 1.0]}
    assert demo._compare(digests, losses, same, 2) == 0
    other_batch = {"digests": ["c", "x"], "losses": [1.25, 1.0]}
    assert demo._compare(digests, losses, other_batch, 2) == 1
    assert "resumed batch of step 4 differs" in capsys.readouterr().out
    other_loss = {"digests": ["c", "d"], "losses": [1.25, 1.0000001]}
    assert demo._compare(digests, losses, other_loss, 2) == 1
    assert "loss curve differs" in capsys.readouterr().out
    short = {"digests": ["c"], "losses": [1.25]}
    assert demo._compare(digests, losses, short, 2) == 1


def test_bad_sizes_are_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--steps", "1"]) == 1
    assert "--steps at least 2" in capsys.readouterr().err
    assert cli.main(["demo", "--steps", "10", "--checkpoint-step", "10"]) == 1
    assert "--checkpoint-step must be in [1, 9]" in capsys.readouterr().err


def test_without_jax_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "jax", None)
    assert cli.main(["demo", "--steps", "4"]) == 1
    assert "pip install jax tqdm" in capsys.readouterr().err


def test_generated_classes_are_learnable_and_records_round_trip() -> None:
    images, labels = demo.generate(50)
    bright_rows = (images[..., 0] >= 128).all(axis=2)
    for image_rows, label in zip(bright_rows, labels, strict=True):
        assert image_rows.nonzero()[0].tolist() == [2 + 2 * label, 3 + 2 * label, 4 + 2 * label]
    decoded = demo.Decode().map(demo.encode(images[7], labels[7]))
    assert decoded["label"] == labels[7]
    assert (decoded["image"] == images[7]).all()
    row = demo.Decode().map({"image": images[3], "label": labels[3]})
    assert row["label"] == labels[3] and (row["image"] == images[3]).all()
