"""How long a JAX training loop waits for its next batch.

The demo's pipeline (``grain_core.demo``: decode 128 generated 28x28 images from bytes,
normalise, batch, as a ``DataLoader`` with a shuffled, repeating ``IndexSampler``) feeds an MLP
sized so that one training step takes longer than the loader needs for one batch. Each
configuration runs the same steps; the limit is the same steps over batches already on the
device (zero waiting).

``nox -s bench`` (``benchmarks/run.py``) reports steps/s of each configuration; the ratio
against "in-memory device batches" is the loop's slowdown from waiting. Run this file
directly for the wait share itself::

    python benchmarks/bench_jax.py [--steps 200]

which prints, per configuration, the loop's wall time, the time spent in ``next()`` and its
share, next to the model's step time and the loader's time per batch measured alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _harness import workload  # noqa: E402

from grain_core import _demo, demo  # noqa: E402
from grain_core.experimental import device_put  # noqa: E402

STEPS = 100
RECORDS = 4096
HIDDEN = 512  # sized so that a step outlasts the loader's time per batch (printed below)

#: label -> (worker processes, device prefetch)
CONFIGS: dict[str, tuple[int, bool]] = {
    "1 worker + device_put": (1, True),
    "1 worker, no device prefetch": (1, False),
    "0 workers + device_put": (0, True),
    "0 workers, no device prefetch": (0, False),
}


def _source() -> list[bytes]:
    images, labels = demo.generate(RECORDS)
    return [demo.encode(image, label) for image, label in zip(images, labels, strict=True)]


def _batches(workers: int, prefetch: bool) -> Iterator[Any]:
    loader = demo.make_loader(_source(), workers)
    if prefetch:
        return iter(device_put(loader, jax.devices()[0]))
    return iter(loader)


def _params() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    sizes = [28 * 28, HIDDEN, HIDDEN, 10]
    return {
        f"w{i}": jnp.asarray(rng.standard_normal((a, b)).astype(np.float32) * np.sqrt(2 / a))
        for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False))
    }


@jax.jit
def _train_step(params: dict[str, Any], batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    def loss_fn(params: dict[str, Any]) -> Any:
        x = batch["image"].reshape(batch["image"].shape[0], -1)
        for i in range(len(params) - 1):
            x = jax.nn.relu(x @ params[f"w{i}"])
        logits = x @ params[f"w{len(params) - 1}"]
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, batch["label"][:, None], axis=1))

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), loss


class _Loop:
    """``steps`` synchronous training steps; ``wait_s`` accumulates the time in ``next()``."""

    def __init__(self, batches: Iterator[Any]) -> None:
        self.batches = batches
        self.params = _params()
        self.wait_s = 0.0

    def run(self, steps: int) -> None:
        for _ in range(steps):
            start = time.perf_counter()
            batch = next(self.batches)
            self.wait_s += time.perf_counter() - start
            self.params, loss = _train_step(self.params, batch)
            loss.block_until_ready()  # the step's compute counts as compute, not as waiting


def _in_memory_batches() -> Iterator[Any]:
    with iter(demo.make_loader(_source(), 0)) as it:
        batches = [jax.device_put(next(it)) for _ in range(STEPS)]
    jax.block_until_ready(batches)
    while True:
        yield from batches


def _loop_pass(make_batches: Callable[[], Iterator[Any]]) -> Callable[[], None]:
    loop = _Loop(make_batches())

    def run() -> None:
        loop.run(STEPS)

    # The harness stops the loader (threads, workers) once the implementation is timed.
    run.close = getattr(loop.batches, "close", lambda: None)  # type: ignore[attr-defined]
    return run


@workload(
    "jax_train_loop",
    elements=STEPS,
    description=f"{STEPS} MLP steps fed by the demo DataLoader (1 worker + device_put)",
)
def jax_train_loop() -> Callable[[], None]:
    return _loop_pass(lambda: _batches(*CONFIGS["1 worker + device_put"]))


@jax_train_loop.baseline("in-memory device batches (zero wait)")
def _() -> Callable[[], None]:
    return _loop_pass(_in_memory_batches)


def _add_config_baseline(label: str) -> None:
    jax_train_loop.baseline(f"grain_core {label}")(
        lambda: _loop_pass(lambda: _batches(*CONFIGS[label]))
    )


for _label in list(CONFIGS)[1:]:
    _add_config_baseline(_label)


def _report(steps: int) -> None:
    warmup = 5
    with iter(demo.make_loader(_source(), 0)) as it:
        next(it)
        start = time.perf_counter()
        for _ in range(steps):
            next(it)
        loader_ms = 1000 * (time.perf_counter() - start) / steps
    limit = _Loop(_in_memory_batches())
    limit.run(warmup)
    start = time.perf_counter()
    limit.run(steps)
    step_ms = 1000 * (time.perf_counter() - start) / steps
    print(
        f"model step (batches already on device): {step_ms:.2f} ms; loader alone, in-process: "
        f"{loader_ms:.2f} ms per batch of {_demo.BATCH_SIZE}"
    )
    print(f"{'configuration':34} {'loop s':>8} {'waiting s':>10} {'waiting %':>10}")
    for label, (workers, prefetch) in {"in-memory device batches": (-1, False), **CONFIGS}.items():
        batches = _in_memory_batches() if workers < 0 else _batches(workers, prefetch)
        loop = _Loop(batches)
        loop.run(warmup)  # workers started, jit compiled, buffers filled
        loop.wait_s = 0.0
        start = time.perf_counter()
        loop.run(steps)
        wall = time.perf_counter() - start
        print(f"{label:34} {wall:8.2f} {loop.wait_s:10.3f} {100 * loop.wait_s / wall:9.1f}%")
        close = getattr(batches, "close", None)
        if close is not None:
            close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per configuration")
    _report(parser.parse_args().steps)
