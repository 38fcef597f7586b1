"""The examples in docs/, run against a real CapyCTL and llama-server.

Deployment files are deployed, curl and Python examples are run, every
`capyctl` command line must name a real command with real options, and the
documented exit-code and status tables must match the code.

Markers in the pages, on the line right before a code block:
    <!-- refused: TEXT -->  a YAML block that `deploy model` must refuse, TEXT in stderr
    <!-- error: CODE -->    a curl block whose answer must be an error with this code
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import msgspec
import pytest
import typer

from capyctl.adapters.config_files import load_yaml
from capyctl.adapters.http.errors import STATUS
from capyctl.entrypoints.cli.app import app
from capyctl.entrypoints.cli.output import EXIT_CODES
from tests.integration.harness import CapyServer, LlamaPaths

DOCS = Path(__file__).parents[2] / "docs"
PAGES = ["quickstart.md", "requests.md", "engines.md", "configuration.md", "cli.md", "errors.md", "development.md"]
DOC_URL = "http://127.0.0.1:8443"
DOC_STATE = "~/.local/state/capyctl"
DOC_MODEL = "/path/to/SmolLM2-135M-Instruct.Q4_1.gguf"
SED_KEY = "KEY=$(sed -n 's/^api_key: //p' ~/.local/state/capyctl/identity/credentials)"
FENCE = re.compile(r"(?:<!-- (refused|error): (.+?) -->\n)?```(\w+)\n(.*?)^```", re.S | re.M)


class Block(NamedTuple):
    page: str
    lang: str
    text: str
    mark: str | None  # "refused" or "error"
    expect: str | None  # the text the mark expects


def blocks(lang: str, *pages: str) -> list[Block]:
    found = []
    for page in pages or PAGES:
        for mark, expect, block_lang, text in FENCE.findall((DOCS / page).read_text()):
            if block_lang == lang:
                found.append(Block(page, lang, text, mark or None, expect or None))
    return found


@pytest.fixture(scope="module")
def served(served: CapyServer, llama: LlamaPaths, tmp_path_factory: pytest.TempPathFactory) -> CapyServer:
    """The shared server, re-deployed with the quick start's own file (it caps answers at 400 tokens)."""
    (quickstart,) = blocks("yaml", "quickstart.md")
    path = tmp_path_factory.mktemp("quickstart") / "smollm2.yaml"
    path.write_text(quickstart.text.replace(DOC_MODEL, str(llama.model)))
    deployed = served.cli_json("deploy", "model", "--file", str(path), "--wait")
    assert (deployed["outcome"], deployed["deployment"]["state"]) == ("updated", "ready")
    return served


def on_server(text: str, served: CapyServer) -> str:
    """A docs example pointed at the test server and its state directory."""
    return text.replace(DOC_URL, served.base_url).replace(DOC_STATE, str(served.state_dir))


def bash(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_every_page_exists_and_is_linked_from_the_readme() -> None:
    readme = (DOCS.parent / "README.md").read_text()
    for page in PAGES:
        assert (DOCS / page).is_file(), page
        assert f"(docs/{page})" in readme, page


def test_links_between_pages_resolve() -> None:
    def anchors(page: str) -> set[str]:  # GitHub's heading anchors
        headings = re.findall(r"^#+ (.+)$", (DOCS / page).read_text(), re.M)
        return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}

    for page in PAGES:
        for target, anchor in re.findall(r"\]\((?:([\w-]+\.md))?(?:#([\w-]+))?\)", (DOCS / page).read_text()):
            assert (target or page) in PAGES, f"{page}: link to {target}"
            assert not anchor or anchor in anchors(target or page), f"{page}: link to {target}#{anchor}"


def test_json_examples_are_json() -> None:
    examples = blocks("json")
    assert len(examples) >= 8
    for block in examples:
        assert isinstance(msgspec.json.decode(block.text), dict), f"{block.page}:\n{block.text}"


def test_yaml_examples_are_accepted_or_refused_as_marked(capy: CapyServer, llama: LlamaPaths, tmp_path: Path) -> None:
    capy.cli("engine", "add", str(llama.server), "--name", "llama-server")
    examples = blocks("yaml")
    assert sum(b.mark is None for b in examples) >= 3 and sum(b.mark == "refused" for b in examples) >= 3
    for i, block in enumerate(examples):
        path = tmp_path / f"example-{i}.yaml"
        path.write_text(block.text.replace(DOC_MODEL, str(llama.model)))
        done = capy.cli("deploy", "model", "--file", str(path), "--json", check=False)
        where = f"{block.page}:\n{block.text}\n{done.stdout}{done.stderr}"
        if block.mark == "refused":
            assert done.returncode != 0 and done.stderr.startswith("error ["), where
            assert block.expect in done.stderr, where
            continue
        assert isinstance(load_yaml(block.text, block.page), dict), where
        assert done.returncode == 0, where
        assert msgspec.json.decode(done.stdout)["outcome"] in ("created", "updated", "unchanged"), where
        # configuration.md: deploying the same file again changes nothing
        assert capy.cli_json("deploy", "model", "--file", str(path))["outcome"] == "unchanged", where
    # without --activate nothing is started (an attached engine is `unavailable` until it answers)
    assert {d["state"] for d in capy.cli_json("list", "deployments")} <= {"stopped", "unavailable"}


def test_the_sed_one_liner_reads_the_key(served: CapyServer) -> None:
    for page in ("quickstart.md", "requests.md"):
        assert SED_KEY in (DOCS / page).read_text(), page
    done = bash(on_server(SED_KEY, served) + '\nprintf %s "$KEY"')
    assert done.returncode == 0, done.stderr
    assert done.stdout == served.api_key


def test_curl_examples_answer_as_documented(served: CapyServer) -> None:
    examples = [b for b in blocks("sh", "quickstart.md", "requests.md", "errors.md") if "curl " in b.text]
    assert len(examples) >= 10
    for block in examples:
        lines = [line for line in block.text.splitlines() if line.strip() != SED_KEY]
        assert all("sed " not in line for line in lines), block.text  # only the known one-liner is skipped
        done = bash(on_server("\n".join(lines), served), KEY=served.api_key)
        where = f"{block.page}:\n{block.text}\n--- output:\n{done.stdout}{done.stderr}"
        assert done.returncode == 0, where
        assert done.stdout.strip(), where
        if block.mark == "error":
            assert f'"code":"{block.expect}"' in done.stdout, where
        else:
            assert '"error":' not in done.stdout, where


def test_python_example_runs(served: CapyServer) -> None:
    examples = blocks("python", "requests.md")
    assert examples
    for block in examples:
        done = subprocess.run([sys.executable, "-c", on_server(block.text, served)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert len([line for line in done.stdout.splitlines() if line.strip()]) >= 2, done.stdout  # reply, stream


def command_path(tokens: list[str]) -> tuple[list[str], list[str]]:
    """The subcommand path at the start of `tokens` (the words after `capyctl`), and the options used."""
    command, path = typer.main.get_command(app), []
    while len(path) < len(tokens) and tokens[len(path)] in getattr(command, "commands", {}):
        command = command.commands[tokens[len(path)]]
        path.append(tokens[len(path)])
    rest = tokens[len(path):]
    is_group = hasattr(command, "commands")
    assert not is_group or rest[:1] and rest[0].startswith("-"), f"not a command: capyctl {' '.join(tokens)}"
    return path, [m.split("=")[0] for m in re.findall(r"(?<![\w-])--?[a-z][a-z-]*", " ".join(rest))]


def test_every_capyctl_command_line_exists_with_its_options() -> None:
    commands = []
    for block in blocks("sh"):
        for line in block.text.replace("\\\n", " ").splitlines():
            if line.startswith("capyctl "):
                commands.append((block.page, line))
    assert len(commands) >= 15 and any(page == "cli.md" for page, _ in commands)
    for page, line in commands:
        path, options = command_path(shlex.split(line)[1:])
        done = subprocess.run([sys.executable, "-m", "capyctl", *path, "--help"], capture_output=True,
                              text=True, env={**os.environ, "COLUMNS": "200"}, timeout=60)
        assert done.returncode == 0, f"{page}: {line}\n{done.stderr}"
        assert f"capyctl {' '.join(path)}".strip() in done.stdout, f"{page}: {line}"
        for option in options:
            assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", done.stdout), f"{page}: {line}: no {option}"


def test_documented_exit_codes_match_the_cli() -> None:
    documented: dict[str, int] = {}
    for status, codes in re.findall(r"^\| (\d) \| (.*?) \|", (DOCS / "cli.md").read_text(), re.M):
        for code in re.findall(r"`(\w+)`", codes):
            documented[code] = int(status)
    assert documented == EXIT_CODES
    assert re.search(r"^\| 1 \| \| any other", (DOCS / "cli.md").read_text(), re.M)


def test_documented_statuses_match_the_http_table() -> None:
    text = (DOCS / "errors.md").read_text()
    codes_section = text.split("\n## Codes\n")[1].split("\n## ")[0]
    rows = [line for line in codes_section.splitlines() if line.startswith("| `")]
    found = [re.match(r"^\| `(\w+)` \| (\d{3}) \| .+ \|$", row) for row in rows]
    assert all(found), [row for row, match in zip(rows, found) if not match]
    assert {m.group(1): int(m.group(2)) for m in found if m} == STATUS
    extra_section = text.split("\n## Extra fields\n")[1].split("\n## ")[0]
    assert set(re.findall(r"^\| `(\w+)` \|", extra_section, re.M)) <= set(STATUS)
