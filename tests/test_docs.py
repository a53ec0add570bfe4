"""Every code block of README.md, docs/*.md and plugins/*/README.md runs, as a reader would
paste it; the conventions are in docs/writing-docs.md.

A page's untagged ``python`` blocks are one program, run in a fresh process in an empty
directory; ``python cluster`` blocks are a second program, run as two JAX processes joined on
127.0.0.1; ``python s3`` blocks a third, run against moto's S3 server on 127.0.0.1 (the
``s3_server`` fixture of tests/conftest.py); ``bash`` blocks run afterwards in the same
directory; ``toml`` blocks must parse; the README's ``bash setup`` block holds exactly the two set-up commands, the second of which
``.ci/run`` runs. Tracebacks name the page and its line numbers. A program that imports a
package this session lacks (a plugin in tests-core, JAX) is skipped, naming the package.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("plugins/*/README.md")])
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*?)[ \t]*$")
# Kinds of block, by their info string (language, then an optional tag).
PROGRAM = ("python", "")
CLUSTER = ("python", "cluster")
S3 = ("python", "s3")
SHELL = ("bash", "")
SETUP = ("bash", "setup")
CONFIG = ("toml", "")
DISPLAY = {("text", ""), ("markdown", "")}
KNOWN = {PROGRAM, CLUSTER, S3, SHELL, SETUP, CONFIG, *DISPLAY}
CLUSTER_PROCESSES = 2
# The bucket that ``python s3`` blocks name (``s3://bucket/...``), created on the test server.
S3_BUCKET = "bucket"
# A hang guard, not a performance bound: each program imports JAX or starts workers.
HANG_TIMEOUT_S = 600
RUN_PROGRAM = "import sys; exec(compile(open(sys.argv[2]).read(), sys.argv[1], 'exec'))"


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the page's line number of the block's first line of code
    kind: tuple[str, str]
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page (CommonMark fences: a closing fence has the
    opening's character, at least as many, and no info string)."""
    found: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening or (opening["fence"][0] == "`" and "`" in opening["info"]):
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        words = opening["info"].split()
        kind = (words[0] if words else "", " ".join(words[1:]))
        start = i + 1
        i = start
        while i < len(lines):
            closing = FENCE.match(lines[i])
            if (
                closing
                and not closing["info"]
                and closing["fence"][0] == fence[0]
                and len(closing["fence"]) >= len(fence)
            ):
                break
            i += 1
        # CommonMark: a fence indented n spaces removes up to n spaces from its lines.
        code = "\n".join(re.sub(f"^ {{0,{indent}}}", "", line) for line in lines[start:i])
        found.append(Block(page, start + 1, kind, code + "\n"))
        i += 1
    return found


def _program(page: Path, kind: tuple[str, str]) -> str:
    """The page's blocks of ``kind`` as one script whose line numbers are the page's."""
    lines = [""] * len(page.read_text().splitlines())
    for block in blocks(page):
        if block.kind == kind:
            for offset, line in enumerate(block.code.splitlines()):
                lines[block.line - 1 + offset] = line
    return "\n".join(lines) + "\n"


def _cases(kind: tuple[str, str]) -> list[Path]:
    return [page for page in PAGES if any(b.kind == kind for b in blocks(page))]


def _skip_unless_importable(program: str, page: Path) -> None:
    for node in ast.walk(ast.parse(program, str(page))):
        names = (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else [node.module]
            if isinstance(node, ast.ImportFrom) and node.module and not node.level
            else []
        )
        for name in names:
            top = name.split(".")[0]
            # grain_core.install_as_grain() serves `grain` (docs/compatibility.md).
            if top == "grain" and "install_as_grain()" in program:
                continue
            if importlib.util.find_spec(top) is None:
                pytest.skip(f"{page.relative_to(ROOT)} imports {name}, not installed here")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", **extra)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run_program(
    page: Path, kind: tuple[str, str], workdir: Path, env: dict[str, str]
) -> subprocess.Popen[str]:
    script = workdir / f".{page.name}.{kind[1] or 'main'}.py"
    script.write_text(_program(page, kind))
    return subprocess.Popen(
        [sys.executable, "-c", RUN_PROGRAM, str(page), str(script)],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(process: subprocess.Popen[str], what: str) -> None:
    try:
        output, _ = process.communicate(timeout=HANG_TIMEOUT_S)
    finally:
        process.kill()
    assert process.returncode == 0, f"{what} failed:\n{output}"


def test_pages_are_found_and_every_block_has_a_known_kind() -> None:
    assert ROOT / "README.md" in PAGES and len(PAGES) >= 4
    unknown = [
        f"{b.where}: ```{' '.join(b.kind).strip()}"
        for page in PAGES
        for b in blocks(page)
        if b.kind not in KNOWN
    ]
    assert not unknown, (
        "code blocks of no known kind (docs/writing-docs.md lists them): " + ", ".join(unknown)
    )


@pytest.mark.parametrize("page", _cases(PROGRAM), ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run_in_order_as_one_program(page: Path, tmp_path: Path) -> None:
    _skip_unless_importable(_program(page, PROGRAM), page)
    _finish(_run_program(page, PROGRAM, tmp_path, _env()), str(page.relative_to(ROOT)))
    shell = [b for b in blocks(page) if b.kind == SHELL]
    for block in shell:
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block.code],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=HANG_TIMEOUT_S,
        )
        assert result.returncode == 0, f"{block.where} failed:\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize("page", _cases(CLUSTER), ids=lambda p: str(p.relative_to(ROOT)))
def test_cluster_blocks_run_on_every_process_of_a_loopback_jax_cluster(
    page: Path, tmp_path: Path
) -> None:
    _skip_unless_importable(_program(page, CLUSTER), page)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    processes = []
    for process_id in range(CLUSTER_PROCESSES):
        workdir = tmp_path / f"host{process_id}"
        workdir.mkdir()
        env = _env(
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES=str(CLUSTER_PROCESSES),
            JAX_PROCESS_ID=str(process_id),
            XLA_FLAGS="--xla_force_host_platform_device_count=2",
        )
        processes.append(_run_program(page, CLUSTER, workdir, env))
    for process_id, process in enumerate(processes):
        _finish(process, f"{page.relative_to(ROOT)} [cluster] on process {process_id}")


@pytest.mark.parametrize("page", _cases(S3), ids=lambda p: str(p.relative_to(ROOT)))
def test_s3_blocks_run_against_a_loopback_s3_server(
    page: Path, tmp_path: Path, s3_server: Any
) -> None:
    _skip_unless_importable(_program(page, S3), page)
    import s3fs  # optional dependency (the s3_server fixture skips without it)

    s3fs.S3FileSystem(**s3_server.storage_options()).makedirs(S3_BUCKET, exist_ok=True)
    # What a reader of the page has: AWS profiles in the standard files, and the store's
    # address where botocore looks for it (so URLs without options reach it too).
    aws = tmp_path / "aws"
    aws.mkdir()
    profiles = ("default", "training")
    (aws / "credentials").write_text(
        "".join(
            f"[{name}]\naws_access_key_id = testing\naws_secret_access_key = testing\n"
            for name in profiles
        )
    )
    region = s3_server.storage_options()["client_kwargs"]["region_name"]
    (aws / "config").write_text(
        "".join(
            f"[{'default' if name == 'default' else f'profile {name}'}]\nregion = {region}\n"
            for name in profiles
        )
    )
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = _env(
        AWS_SHARED_CREDENTIALS_FILE=str(aws / "credentials"),
        AWS_CONFIG_FILE=str(aws / "config"),
        AWS_ENDPOINT_URL_S3=s3_server.endpoint,
    )
    for variable in ("AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "FSSPEC_S3"):
        env.pop(variable, None)
    _finish(_run_program(page, S3, workdir, env), f"{page.relative_to(ROOT)} [s3]")


@pytest.mark.parametrize("page", _cases(CONFIG), ids=lambda p: str(p.relative_to(ROOT)))
def test_toml_blocks_parse(page: Path) -> None:
    for block in blocks(page):
        if block.kind == CONFIG:
            tomllib.loads(block.code)


def test_readme_setup_is_two_commands_and_ci_runs_the_second() -> None:
    (setup,) = [b for b in blocks(ROOT / "README.md") if b.kind == SETUP]
    commands = [line for line in setup.code.splitlines() if line.strip()]
    assert len(commands) == 2
    assert "# 1. " in commands[0] and "# 2. " in commands[1]
    # .ci/run runs the command it reads from the README: the same extraction, run dry.
    ci = (ROOT / ".ci" / "run").read_text()
    extraction = re.search(r"test_command=\$\(\n(.*?)\n\)", ci, re.DOTALL)
    assert extraction, ".ci/run no longer reads its command from the README"
    extracted = subprocess.run(
        ["bash", "-c", extraction[1]], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert extracted == commands[1].split("# 2. ")[0].strip()
    assert 'eval "$test_command"' in ci
    # Both commands work from a stock system Python (PEP 668): they install into .venv only.
    for command in commands:
        assert command.startswith("python3 -m venv .venv && .venv/bin/pip install ")


def test_the_readme_pipeline_type_checks_without_annotations(tmp_path: Path) -> None:
    """The README's first pipeline passes mypy and pyright as a user writes it (no annotation
    on ``ds``): ``batch()`` without ``batch_fn`` has a type a checker can infer."""
    (pipeline,) = [
        b for b in blocks(ROOT / "README.md") if b.kind == PROGRAM and ".batch(" in b.code
    ][:1]
    user_code = tmp_path / "readme_pipeline.py"
    user_code.write_text(pipeline.code)
    # grain_core as an installed package is to a checker: found, its own errors not reported.
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\n[mypy-grain_core.*]\nfollow_imports = silent\n")
    checkers = []
    if importlib.util.find_spec("mypy") is not None:
        checkers.append(
            [sys.executable, "-m", "mypy", "--no-incremental", "--config-file", str(config)]
        )
    pyright = shutil.which("basedpyright", path=os.path.dirname(sys.executable))
    if pyright is not None:
        settings = {"extraPaths": [str(ROOT)], "typeCheckingMode": "standard"}
        (tmp_path / "pyrightconfig.json").write_text(json.dumps(settings))
        checkers.append([pyright, "--pythonpath", sys.executable])
    if not checkers:
        pytest.skip("neither mypy nor basedpyright is installed (nox -s typecheck has both)")
    # An editable install is an import hook that mypy does not follow: the checkout's path.
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    for checker in checkers:
        done = subprocess.run(
            [*checker, str(user_code)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
            check=False,
        )
        assert done.returncode == 0, f"{pipeline.where}: {' '.join(checker)}\n{done.stdout}"
