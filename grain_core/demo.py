"""``grain-core demo``: train a small JAX model from a file, get preempted, resume bit-exactly.

1. Writes a generated image-classification data set (28x28 grey images of 10 classes) through a
   format plugin (``--format``; ArrayRecord by default).
2. Reads it with the seed pipeline as a ``DataLoader`` with worker processes (``--workers``):
   shuffled with seed 42, repeated, decoded and normalised, batches of 128.
3. Trains a two-layer MLP with plain ``jax`` (SGD), feeding it through
   ``grain_core.experimental.device_put``; saves the loader position and the parameters at
   ``--checkpoint-step``.
4. Simulates a preemption: a fresh process restores both and trains to ``--steps``; its
   batches (SHA-1 of their bytes) and losses must be bit-identical to the uninterrupted run's.

It prints the loss curve, the loader's throughput, the share of the training loop spent waiting
for data and the execution summary, and exits with status 1 if the resumed run differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np

import grain_core as grain
from grain_core import _demo, plugins, transforms
from grain_core._progress import progress
from grain_core.checkpoint import CheckpointHandler
from grain_core.storage import write_bytes

__all__ = ["add_arguments", "run"]

#: Format name -> (file name, distribution, directory of the plugin in a source checkout).
FORMATS = {
    "arrayrecord": ("images.array_record", "grainpipe-arrayrecord", "plugins/grain_arrayrecord"),
    "parquet": ("images.parquet", "grainpipe-parquet", "plugins/grain_parquet"),
    "tfrecord": ("images.tfrecord", "grainpipe-tfrecord", "plugins/grain_tfrecord"),
}
DEMO_INSTALL_HINT = "pip install jax tqdm"
_PIXELS = int(np.prod(_demo.IMAGE_SHAPE))
_CLASSES = 10
#: The widest line the demo prints.
_LINE = 100
_HIDDEN = 256
_LEARNING_RATE = 0.1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the demo's options to its sub-command parser."""
    parser.add_argument("--format", choices=sorted(FORMATS), default="arrayrecord")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (2)")
    parser.add_argument("--records", type=int, default=10_000, help="records to write (10000)")
    parser.add_argument("--steps", type=int, default=300, help="training steps (300)")
    parser.add_argument(
        "--checkpoint-step", type=int, help="step after which to checkpoint (steps // 2)"
    )
    parser.add_argument("--dir", help="working directory to keep (default: a temporary one)")
    # The preempted run's second life, started by the demo itself.
    parser.add_argument("--resume-from", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """Runs the demo (or, with ``--resume-from``, its resumed half); returns the exit status.

    Raises:
      ValueError: For non-positive sizes or a checkpoint step outside ``[1, steps)``.
    """
    if args.records < _demo.BATCH_SIZE or args.steps < 2 or args.workers < 0:
        raise ValueError(
            f"--records must be at least {_demo.BATCH_SIZE}, --steps at least 2 and --workers "
            "non-negative."
        )
    checkpoint_step = args.checkpoint_step or args.steps // 2
    if not 1 <= checkpoint_step < args.steps:
        raise ValueError(f"--checkpoint-step must be in [1, {args.steps - 1}].")
    try:
        import jax  # noqa: F401  # optional dependency, imported to check
    except ImportError:
        print(
            f"grain-core demo trains a JAX model; install JAX: {DEMO_INSTALL_HINT}", file=sys.stderr
        )
        return 1
    if args.resume_from:
        if not args.dir:
            raise ValueError("--resume-from needs --dir, the directory holding the data file.")
        return _resume(args, Path(args.resume_from), checkpoint_step)
    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="grain-core-demo-"))
    try:
        return _main_run(args, workdir, checkpoint_step)
    finally:
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)


# --------------------------------------------------------------------------------- the data
def generate(num_records: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Images whose class is a bright horizontal band (one row band per class) plus noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, _CLASSES, size=num_records)
    images = rng.integers(0, 96, size=(num_records, *_demo.IMAGE_SHAPE), dtype=np.uint8)
    rows = 2 + 2 * labels  # class k lights rows 2+2k .. 4+2k
    for offset in range(3):
        images[np.arange(num_records), rows + offset, :, 0] += 128
    return images, labels


def encode(image: np.ndarray, label: int) -> bytes:
    """One record for byte-oriented formats: the label byte, then the image's pixels."""
    return bytes([int(label)]) + image.tobytes()


class Decode(transforms.Map):
    """Bytes (ArrayRecord, TFRecord) or a row dict (Parquet) -> ``{"image", "label"}``."""

    def map(self, element: Any) -> dict[str, Any]:
        if isinstance(element, dict):
            return {"image": np.asarray(element["image"], np.uint8), "label": int(element["label"])}
        pixels = np.frombuffer(element, np.uint8, offset=1)
        return {"image": pixels.reshape(_demo.IMAGE_SHAPE), "label": element[0]}


class Normalise(transforms.Map):
    """The seed pipeline's ``map(normalise)``: float32 pixels in [0, 1], int32 labels."""

    def map(self, element: dict[str, Any]) -> dict[str, Any]:
        out = _demo.normalise(element)
        return {"image": out["image"], "label": np.int32(out["label"])}


def write_dataset(fmt: str, workdir: Path, num_records: int) -> tuple[Any, str]:
    """Writes the data set through the format plugin; returns ``(source, description)``.

    Without the plugin the records stay in memory, and the description says what to install.
    """
    file_name, _, directory = FORMATS[fmt]
    images, labels = generate(num_records)
    try:
        spec = plugins.get_format(fmt)
    except plugins.PluginError as err:
        print(
            f"note: the {fmt} format plugin is not installed ({err}). Install it with "
            f"`{plugins.plugin_install_command(directory.removeprefix('plugins/'))}` to read "
            "from a file; this run reads in-memory records instead."
        )
        return [encode(im, lb) for im, lb in zip(images, labels, strict=True)], "in-memory records"
    path = workdir / file_name
    if not path.exists():
        with spec.get("writer")(str(path)) as writer:
            for image, label in zip(images, labels, strict=True):
                writer.write(
                    {"image": image, "label": int(label)}
                    if fmt == "parquet"
                    else encode(image, label)
                )
    size = path.stat().st_size
    return spec.get("source")(str(path)), f"{path.name} ({fmt}, {size / 1e6:.1f} MB)"


def make_loader(source: Any, workers: int) -> Any:
    """The seed pipeline as a DataLoader: shuffle(seed 42), repeat, decode, normalise, batch."""
    return grain.DataLoader(
        data_source=source,
        sampler=grain.samplers.IndexSampler(len(source), shuffle=True, seed=42, num_epochs=None),
        operations=[Decode(), Normalise(), transforms.Batch(_demo.BATCH_SIZE, drop_remainder=True)],
        worker_count=workers,
    )


# -------------------------------------------------------------------------------- the model
def init_params(seed: int = 0) -> dict[str, Any]:
    """He-initialised weights of a ``784 -> 256 -> 10`` MLP, as NumPy arrays."""
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((_PIXELS, _HIDDEN)) * np.sqrt(2 / _PIXELS)).astype(np.float32),
        "b1": np.zeros(_HIDDEN, np.float32),
        "w2": (rng.standard_normal((_HIDDEN, _CLASSES)) * np.sqrt(2 / _HIDDEN)).astype(np.float32),
        "b2": np.zeros(_CLASSES, np.float32),
    }


def make_train_step() -> Any:
    """A jitted SGD step ``(params, batch) -> (params, loss)`` of softmax cross-entropy."""
    import jax  # optional dependency
    import jax.numpy as jnp  # optional dependency

    def loss_fn(params: dict[str, Any], batch: dict[str, Any]) -> Any:
        x = batch["image"].reshape(batch["image"].shape[0], -1)
        hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
        logits = hidden @ params["w2"] + params["b2"]
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, batch["label"][:, None], axis=1))

    @jax.jit
    def train_step(params: dict[str, Any], batch: dict[str, Any]) -> tuple[Any, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        new = jax.tree.map(lambda p, g: p - _LEARNING_RATE * g, params, grads)
        return new, loss

    return train_step


def _digest(batch: dict[str, Any]) -> str:
    sha = hashlib.sha1()
    for key in sorted(batch):
        sha.update(np.asarray(batch[key]).tobytes())
    return sha.hexdigest()


def _device_iterator(loader: Any, *, track: bool) -> Any:
    import jax  # optional dependency

    from grain_core.experimental import (  # import cost
        DatasetOptions,
        ExecutionTrackingMode,
        WithOptionsIterDataset,
        device_put,
    )

    ds = device_put(loader, jax.devices()[0])
    if track:
        options = DatasetOptions(execution_tracking_mode=ExecutionTrackingMode.STAGE_TIMING)
        ds = WithOptionsIterDataset(ds, options)
    return iter(ds)


class _Training:
    """Runs steps ``[first, last)``, recording each batch's digest and loss."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.train_step = make_train_step()
        self.params = params
        self.digests: list[str] = []
        self.losses: list[Any] = []
        self.wait_s = 0.0
        self.wall_s = 0.0

    def run(self, it: Any, first: int, last: int, on_step: Any = None) -> None:
        start = time.perf_counter()
        for step in progress(range(first, last), last - first, "steps"):
            before = time.perf_counter()
            batch = next(it)
            self.wait_s += time.perf_counter() - before
            self.digests.append(_digest(batch))
            self.params, loss = self.train_step(self.params, batch)
            self.losses.append(loss)
            if on_step is not None:
                on_step(step + 1)
        self.wall_s += time.perf_counter() - start

    def float_losses(self) -> list[float]:
        return [float(x) for x in self.losses]


def _save_checkpoint(directory: Path, it: Any, params: dict[str, Any], step: int) -> None:
    CheckpointHandler().save(directory / "loader", it)
    host_params: dict[str, Any] = {k: np.asarray(v) for k, v in params.items()}
    tmp = directory / "params.tmp.npz"
    np.savez(tmp, **host_params)
    os.replace(tmp, directory / "params.npz")
    write_bytes(directory / "step.json", json.dumps({"step": step}).encode())


def _main_run(args: argparse.Namespace, workdir: Path, checkpoint_step: int) -> int:
    import jax  # optional dependency

    from grain_core.experimental import get_execution_summary  # import cost

    workdir.mkdir(parents=True, exist_ok=True)
    source, description = write_dataset(args.format, workdir, args.records)
    _say("data:", f"{args.records:,} generated 28x28 images of 10 classes -> {description}")
    _say(
        "pipeline:",
        f"DataLoader({args.workers} workers): IndexSampler(shuffle, seed=42, repeat) "
        f"-> decode -> normalise -> batch({_demo.BATCH_SIZE}, drop_remainder=True) "
        f"-> device_put({jax.devices()[0]})",
    )
    loader = make_loader(source, args.workers)
    measured = min(args.steps, 100)
    per_batch = _loader_seconds_per_batch(loader, measured)
    _say(
        "loader:",
        f"{1 / per_batch:,.0f} batches/s ({_demo.BATCH_SIZE / per_batch:,.0f} images/s) over "
        f"{measured} batches, without training",
    )

    checkpoint_dir = workdir / "checkpoint"
    training = _Training(init_params())
    it = _device_iterator(loader, track=True)

    def maybe_checkpoint(step: int) -> None:
        if step == checkpoint_step:
            _save_checkpoint(checkpoint_dir, it, training.params, step)

    _say(
        "train:",
        f"{args.steps} steps of a 784-{_HIDDEN}-10 MLP (SGD, plain jax), "
        f"checkpoint after step {checkpoint_step}",
    )
    training.run(it, 0, args.steps, maybe_checkpoint)
    losses = training.float_losses()
    _say(
        "",
        f"{args.steps} steps in {training.wall_s:.2f} s; waiting for batches: "
        f"{training.wait_s:.2f} s ({100 * training.wait_s / training.wall_s:.1f}% of the loop). "
        + _why_the_loop_waits(training, args.steps, per_batch),
    )
    shown = sorted({0, *range(0, args.steps, max(1, args.steps // 6)), args.steps - 1})
    _say("loss:", "  ".join(f"{s + 1}:{losses[s]:.4f}" for s in shown))
    print(get_execution_summary(it).to_text(width=_LINE))
    it.close()

    _say(
        "preempt:",
        f"a fresh process restores the loader and parameters from step {checkpoint_step}",
    )
    resumed = _run_resumed_process(args, workdir, checkpoint_dir, checkpoint_step)
    if resumed is None:
        return 1
    return _compare(training.digests, losses, resumed, checkpoint_step)


def _loader_seconds_per_batch(loader: Any, batches: int) -> float:
    """Seconds the loader takes per batch when nothing else runs (after its first batch)."""
    with iter(loader) as it:
        next(it)  # workers started and warm
        start = time.perf_counter()
        for _ in range(batches):
            next(it)
        return (time.perf_counter() - start) / batches


def _say(label: str, text: str) -> None:
    """Prints ``text`` after ``label`` in lines of at most ``_LINE`` characters."""
    print(textwrap.fill(text, _LINE, initial_indent=f"{label:<10}", subsequent_indent=" " * 10))


def _why_the_loop_waits(training: Any, steps: int, loader_s: float) -> str:
    """A word on the loop's wait: this small model's step against the loader's time per batch,
    on cores the workers share with the training step."""
    step_s = max(0.0, training.wall_s - training.wait_s) / steps
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if step_s < loader_s:
        return (
            f"The loop waits because this small model's step ({1000 * step_s:.1f} ms) is "
            f"shorter than the loader needs per batch ({1000 * loader_s:.1f} ms measured above), "
            f"and training shares this machine's {cores} cores with the workers; a real model's "
            "longer step hides the loading."
        )
    return (
        f"A step ({1000 * step_s:.1f} ms) is longer than the loader needs per batch "
        f"({1000 * loader_s:.1f} ms): the wait is the first batch (the workers starting) and "
        f"moments when training and the workers competed for this machine's {cores} cores."
    )


def _run_resumed_process(
    args: argparse.Namespace, workdir: Path, checkpoint_dir: Path, checkpoint_step: int
) -> dict[str, Any] | None:
    command = [
        sys.executable, "-m", "grain_core", "demo",
        "--format", args.format, "--workers", str(args.workers),
        "--records", str(args.records), "--steps", str(args.steps),
        "--checkpoint-step", str(checkpoint_step), "--dir", str(workdir),
        "--resume-from", str(checkpoint_dir),
    ]  # fmt: skip
    try:
        done = subprocess.run(command, timeout=600, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        print("FAILED: the resumed process did not finish within 600 s.", file=sys.stderr)
        return None
    if done.returncode != 0:
        print(f"FAILED: the resumed process exited with {done.returncode}:\n{done.stderr}",
              file=sys.stderr)  # fmt: skip
        return None
    report: dict[str, Any] = json.loads((checkpoint_dir / "resumed.json").read_text())
    return report


def _resume(args: argparse.Namespace, checkpoint_dir: Path, checkpoint_step: int) -> int:
    step = json.loads((checkpoint_dir / "step.json").read_text())["step"]
    if step != checkpoint_step:
        raise ValueError(f"{checkpoint_dir} holds step {step}, not {checkpoint_step}.")
    source, _ = write_dataset(args.format, Path(args.dir), args.records)
    it = _device_iterator(make_loader(source, args.workers), track=False)
    CheckpointHandler().restore(checkpoint_dir / "loader", it)
    with np.load(checkpoint_dir / "params.npz") as saved:
        training = _Training({k: saved[k] for k in saved.files})
    training.run(it, checkpoint_step, args.steps)
    it.close()
    report = {"digests": training.digests, "losses": training.float_losses()}
    write_bytes(checkpoint_dir / "resumed.json", json.dumps(report).encode())
    return 0


def _compare(
    digests: list[str], losses: list[float], resumed: dict[str, Any], checkpoint_step: int
) -> int:
    expected_digests, expected_losses = digests[checkpoint_step:], losses[checkpoint_step:]
    for offset, (want, got) in enumerate(zip(expected_digests, resumed["digests"], strict=False)):
        if want != got:
            print(f"FAILED: resumed batch of step {checkpoint_step + offset + 1} differs.")
            return 1
    if len(resumed["digests"]) != len(expected_digests) or resumed["losses"] != expected_losses:
        print("FAILED: the resumed loss curve differs from the uninterrupted one.")
        return 1
    _say(
        "resume:",
        f"OK: steps {checkpoint_step + 1}-{len(digests)} after the restart read the "
        f"same {len(expected_digests)} batches (SHA-1 of their bytes) and gave bit-identical "
        f"losses (last {expected_losses[-1]!r}).",
    )
    return 0
