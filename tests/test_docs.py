"""The docs site (docs/, mkdocs.yml) cannot rot: the config reference is regenerated from the schema and
compared, every command a guide marks runnable is run, and the site builds with mkdocs --strict (a broken
link or anchor fails).

Markers, on the line before a ```bash fence in docs/*.md (every bash block carries one):
    <!-- run -->              the block runs (bash -euo pipefail, the page's blocks in order, one scratch dir
                              per page holding links to the checkout's top-level dirs); it must exit 0
    <!-- run: fails -->       each command must exit non-zero; its `# ` lines are text its output must contain
    <!-- not run: reason -->  shown only (training runs, GPUs, clusters)
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
FENCE = re.compile(r"^(?P<marker><!--\s*(?P<kind>run: fails|run|not run:.*?)\s*-->\n)?```bash\n(?P<body>.*?)^```$",
                   re.M | re.S)
BIN = str(Path(sys.executable).parent)


def _blocks(page: Path) -> list[tuple[str | None, str, int]]:
    text = page.read_text()
    return [(m["kind"], m["body"], text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


def _env(*first_on_path: Path) -> dict:
    path = os.pathsep.join([*map(str, first_on_path), BIN, os.environ.get("PATH", "")])
    return {**os.environ, "PATH": path, "NO_MKDOCS_2_WARNING": "1"}


@pytest.fixture(scope="module")
def warm_megappo(tmp_path_factory):
    """The dir of a `megappo` whose calls fork one warm interpreter (tests/cli_server.py) with the modules of every
    subcommand the pages run already imported: the commands run in bash as written, ~0.1 s each instead of 2 s."""
    from cli_server import warm_megappo

    commands = {c for p in PAGES for kind, body, _ in _blocks(p) if kind and kind.startswith("run")
                for c in re.findall(r"\bmegappo (\w+)", body)}
    with warm_megappo(tmp_path_factory.mktemp("warm_megappo"), sorted(commands)) as bin_dir:
        yield bin_dir


def _scratch(tmp_path: Path) -> Path:
    """A dir that looks like the checkout (links to its top-level entries; no assets or outputs, as in a fresh clone) where commands may write."""
    for entry in ROOT.iterdir():
        if not entry.name.startswith(".") and entry.name not in ("outputs", "site", "assets"):
            (tmp_path / entry.name).symlink_to(entry)
    (tmp_path / "outputs").mkdir()
    return tmp_path


def _run_failing(body: str, cwd: Path, env: dict):
    command = "\n".join(ln for ln in body.splitlines() if not ln.startswith("#"))
    expected = [ln[2:] for ln in body.splitlines() if ln.startswith("# ")]
    r = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, text=True, capture_output=True, timeout=120)
    return command, expected, r.returncode, r.stdout + r.stderr


def test_config_reference_is_current():
    sys.path.insert(0, str(ROOT))
    from tools.gen_config_ref import OUT, render

    assert OUT.is_file() and OUT.read_text() == render(), (
        "docs/config.md is stale (megappo/config/schema.py changed): run `python tools/gen_config_ref.py` "
        "(or `make docs`) and commit docs/config.md")


def test_every_bash_block_is_marked():
    unmarked = [f"{p.relative_to(ROOT)}:{line}" for p in PAGES for kind, _, line in _blocks(p) if kind is None]
    assert not unmarked, ("bash blocks without <!-- run -->, <!-- run: fails --> or <!-- not run: reason --> "
                          f"on the line before: {unmarked}")
    assert sum(kind == "run" for p in PAGES for kind, _, _ in _blocks(p)) >= 10


@pytest.mark.parametrize("page", [p.name for p in PAGES if any(k and k.startswith("run") for k, _, _ in _blocks(p))])
def test_runnable_commands(page, tmp_path, warm_megappo):
    cwd, env = _scratch(tmp_path), _env(warm_megappo)
    t0 = time.monotonic()
    blocks = _blocks(DOCS / page)
    for kind, body, line in blocks:  # in order: a block may use what an earlier one wrote
        if kind == "run":
            r = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=cwd, env=env, text=True,
                               capture_output=True, timeout=120)
            assert r.returncode == 0, f"docs/{page}:{line}: exit {r.returncode}\n{body}\n--- output:\n{r.stdout}{r.stderr}"
    failing = [(body, line) for kind, body, line in blocks if kind == "run: fails"]
    with ThreadPoolExecutor(4) as pool:  # independent one-liners: side by side
        results = list(pool.map(lambda b: _run_failing(b[0], cwd, env), failing))
    for (body, line), (command, expected, rc, out) in zip(failing, results):
        where = f"docs/{page}:{line}"
        assert rc != 0, f"{where}: expected a failure, got exit 0\n{command}\n--- output:\n{out}"
        for text in expected:
            assert text in out, f"{where}: the page says the output contains\n  {text}\nbut it is\n{out}"
    print(f"docs/{page}: runnable blocks in {time.monotonic() - t0:.1f} s")


def test_docs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.fail("MkDocs is not installed in this venv: run `make docs-install` (requirements-docs.txt; "
                    "`make test` runs it)")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                        "--site-dir", str(tmp_path / "site")], cwd=ROOT, env=_env(), text=True,
                       capture_output=True, timeout=300)
    assert r.returncode == 0, f"mkdocs build --strict failed (a warning is an error):\n{r.stdout}{r.stderr}"
    assert (tmp_path / "site" / "config" / "index.html").is_file()
    print(f"mkdocs build --strict in {time.monotonic() - t0:.1f} s")


def test_readme_is_one_screen_and_ci_runs_its_test_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 60, "README.md is one screen: measurements go to docs/results.md"
    assert "make test" in readme and "make demo" in readme
    assert re.search(r"^make test\b", (ROOT / ".ci" / "run").read_text(), re.M), ".ci/run must run the README's `make test`"
    for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if not link.startswith("http"):
            assert (ROOT / link).exists(), f"README.md links to {link}, which does not exist"
