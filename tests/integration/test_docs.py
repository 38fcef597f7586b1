"""The examples in docs/, run against a real CapyCTL and llama-server.

Deployment files are deployed, curl and Python examples are run, every
`capyctl` command line must name a real command with real options, and the
documented exit-code and status tables must match the code.

Markers in the pages, on the line right before a code block:
    <!-- refused: TEXT -->  a YAML block that `deploy model` must refuse, TEXT in stderr
    <!-- error: CODE -->    a curl block whose answer must be an error with this code
    <!-- needs: FAMILY -->  a deployment file for an engine family the tests do not install
                            (vLLM, ...): not deployed, but decoded with CapyCTL's strict
                            schema and checked against that family's owned options and
                            environment variables
    <!-- replay: ENGINE/VERSION -->  a deployment file attached to a replay engine at
                            http://127.0.0.1:8100: the test starts a replay engine on that
                            recording folder, points the file at it, deploys it with --wait
                            and runs the page's curl examples against it (the port in the
                            page is only an example, so nothing is deployed against an
                            engine that is not running)
    <!-- other: WHAT -->    a YAML block that is not a deployment file (a Prometheus
                            configuration, ...): only checked to be a YAML mapping
    <!-- host: NAME -->     a deployment file for host NAME: decoded with the strict schema here;
                            tests/integration/several/test_serving.py deploys it on a host
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import msgspec
import pytest
import typer
from prometheus_client.parser import text_string_to_metric_families

from capyctl.adapters.config_files import load_yaml
from capyctl.adapters.engines.llamacpp import LlamaCppEngine
from capyctl.adapters.engines.sglang import SglangEngine
from capyctl.adapters.engines.tensorfold import TensorfoldEngine
from capyctl.adapters.engines.vllm import VllmEngine
from capyctl.adapters.http.errors import STATUS
from capyctl.domain.deployments import check_env, check_extra_args
from capyctl.domain.fields import FIELD_TABLE
from capyctl.entrypoints.cli.app import app
from capyctl.entrypoints.cli.output import EXIT_CODES
from capyctl.services.fleet import decode_spec
from tests.integration.harness import CapyServer, LlamaPaths, deployment_file

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"
SRC = ROOT / "src" / "capyctl"
RECORDINGS = ROOT / "tests" / "contract" / "recordings"
PAGES = [
    "quickstart.md",
    "requests.md",
    "decisions.md",
    "engines.md",
    "configuration.md",
    "cli.md",
    "keys.md",
    "errors.md",
    "parking.md",
    "observability.md",
    "replay.md",
    "development.md",
    "dashboard.md",
    "several-machines.md",
]
DOC_URL = "http://127.0.0.1:8443"
DOC_STATE = "~/.local/state/capyctl"
DOC_MODEL = "/path/to/SmolLM2-135M-Instruct.Q4_1.gguf"
DOC_REPLAY = "http://127.0.0.1:8100"  # where replay.md's demo runs its replay engine
DOC_MANAGEMENT = "http://127.0.0.1:7443"
SED_KEY = "KEY=$(sed -n 's/^api_key: //p' ~/.local/state/capyctl/identity/credentials)"
# a fence may be indented (a code block inside a list item): its closing ``` is then indented too
FENCE = re.compile(
    r"(?:<!-- (refused|error|needs|replay|other|config|host): (.+?) -->\n)?```(\w+)\n(.*?)^ *```", re.S | re.M
)
ADAPTERS = {str(a.family): a for a in (LlamaCppEngine, VllmEngine, SglangEngine, TensorfoldEngine)}


class Block(NamedTuple):
    page: str
    lang: str
    text: str
    mark: str | None  # "refused", "error", "needs", "replay" or "other"
    expect: str | None  # the text the mark expects


def page_blocks(page: str) -> list[Block]:
    """Every code block of a page, in order."""
    return [
        Block(page, lang, textwrap.dedent(text), mark or None, expect or None)
        for mark, expect, lang, text in FENCE.findall((DOCS / page).read_text())
    ]


def blocks(lang: str, *pages: str) -> list[Block]:
    return [block for page in pages or PAGES for block in page_blocks(page) if block.lang == lang]


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


def section(page: str, heading: str) -> str:
    """The text under a `## heading` of a page, up to the next `## ` heading (its ### parts included)."""
    return (DOCS / page).read_text().split(f"\n## {heading}\n")[1].split("\n## ")[0]


def bash(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )


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
    examples = [b for b in blocks("yaml") if b.mark in (None, "refused")]  # the others: tests below
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


def test_the_models_listing_example_is_what_a_ready_model_answers(served: CapyServer) -> None:
    (example,) = [b for b in blocks("json", "requests.md") if '"object":"list"' in b.text]
    (shown,) = msgspec.json.decode(example.text)["data"]
    answer = httpx.get(served.base_url + "/v1/models", headers=served.headers(), timeout=10).json()["data"]
    (listed,) = [m for m in answer if m["id"] == shown["id"]]
    assert shown.keys() == listed.keys()
    for field in ("object", "owned_by", "engine", "state", "loaded", "context_length", "cold_start_s"):
        assert (field, shown[field]) == (field, listed[field])
    assert listed["cold_start_s"] == 0.0  # ready: nothing to wait for, whatever its starts took


def run_curl_block(block: Block, server: CapyServer, replay_url: str = DOC_REPLAY) -> str:
    """Run one curl example against `server` (and a replay engine); its standard output."""
    lines = [line for line in block.text.splitlines() if line.strip() != SED_KEY]
    assert all("sed " not in line for line in lines), block.text  # only the known one-liner is skipped
    done = bash(on_server("\n".join(lines), server).replace(DOC_REPLAY, replay_url), KEY=server.api_key)
    where = f"{block.page}:\n{block.text}\n--- output:\n{done.stdout}{done.stderr}"
    assert done.returncode == 0, where
    assert done.stdout.strip(), where
    if block.mark == "error":
        assert f'"code":"{block.expect}"' in done.stdout, where
    else:
        assert '"error":' not in done.stdout, where
    return done.stdout


def test_curl_examples_answer_as_documented(served: CapyServer) -> None:
    pages = ("quickstart.md", "requests.md", "errors.md", "observability.md")
    examples = [b for b in blocks("sh", *pages) if "curl " in b.text]
    assert len(examples) >= 11
    for block in examples:
        run_curl_block(block, served)


KEY_FORM = re.compile(r"capy_([a-z2-7]{10})_[A-Za-z0-9_-]{43}")


def run_keys_block(
    block: Block, server: CapyServer, kept: dict[str, str], tmp: Path
) -> subprocess.CompletedProcess[str]:
    """Run one shell example of keys.md for real: `capyctl` is this checkout's, talking to `server`, and a
    variable a block sets (`APP_KEY=$(capyctl create key ...)`) is set for the blocks after it."""
    names = re.findall(r"^(\w+)=\$\(", block.text, re.M)
    script = on_server(block.text, server).replace(DOC_MANAGEMENT, f"http://127.0.0.1:{server.management_port}")
    script += "".join(f'\nprintf %s "${name}" > {shlex.quote(str(tmp / name))}' for name in names)
    done = bash(
        script,
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        CAPYCTL_STATE_DIR=str(server.state_dir),
        **kept,
    )
    where = f"{block.page}:\n{block.text}\n--- output:\n{done.stdout}{done.stderr}"
    assert done.returncode == 0, where
    kept.update({name: (tmp / name).read_text() for name in names})
    if block.mark == "error":
        assert f'"code":"{block.expect}"' in done.stdout, where
    else:
        assert '"error":' not in done.stdout, where
    return done


def test_keys_examples_run_as_documented(capy: CapyServer, llama: LlamaPaths, tmp_path: Path) -> None:
    """keys.md's shell examples, in the page's order, against a fresh CapyCTL serving the quick start's
    smollm2 (and a deployment named gpt-4o, never started, which a key scoped to smollm2 must not see):
    create a key, use it, list the keys, revoke it and be refused; a daily limit reached; a model scope;
    a bound salt on llama.cpp; the management API; the key's name in the log, the events and the metrics.
    The documented outputs are compared with what the commands printed."""
    capy.cli("engine", "add", str(llama.server), "--name", "llama-server")
    (quickstart,) = blocks("yaml", "quickstart.md")
    (tmp_path / "smollm2.yaml").write_text(quickstart.text.replace(DOC_MODEL, str(llama.model)))
    capy.cli("deploy", "model", "--file", str(tmp_path / "smollm2.yaml"), "--wait")
    capy.cli("deploy", "model", "--file", str(deployment_file(tmp_path, "gpt-4o", "llama-server", llama.model)))

    page = page_blocks("keys.md")
    examples = [b for b in page if b.lang == "sh"]
    assert len(examples) >= 12 and SED_KEY in examples[0].text
    kept: dict[str, str] = {}
    (tmp_path / "kept").mkdir()
    runs = [(block, run_keys_block(block, capy, kept, tmp_path / "kept")) for block in examples]

    def ran(fragment: str) -> subprocess.CompletedProcess[str]:
        (done,) = [done for block, done in runs if fragment in block.text]
        return done

    def shown(fragment: str) -> str:
        (block,) = [b for b in page if b.lang in ("text", "json") and fragment in b.text]
        return block.text

    def key_id(key: str) -> str:
        found = KEY_FORM.fullmatch(key)
        assert found, key
        return found.group(1)

    assert kept["KEY"] == capy.api_key
    app_id = key_id(kept["APP_KEY"])
    # created: the key alone on stdout, the documented summary on stderr
    create = ran("APP_KEY=$(capyctl create key app1")
    assert create.stdout == "" and create.stderr == shown("key app1 created")
    (used,) = [done for block, done in runs if "Bearer $APP_KEY" in block.text and block.mark is None]
    assert msgspec.json.decode(used.stdout)["object"] == "chat.completion"
    # --json: the documented record, its secret a key
    record, documented = (
        msgspec.json.decode(ran("create key batch --json").stdout),
        msgspec.json.decode(shown('"name": "batch"')),
    )
    assert record.keys() == documented.keys() and key_id(record["secret"]) == record["id"]
    assert {k: v for k, v in record.items() if k not in ("id", "created", "secret")} == {
        k: v for k, v in documented.items() if k not in ("id", "created", "secret")
    }
    # the list: the same header, and the same rows but for the times
    listed, table_shown = ran("capyctl list keys").stdout.splitlines(), shown("NAME     CREATED").splitlines()
    assert listed[0] == table_shown[0]

    def untimed(row: str) -> list[str]:
        cells = re.split(r"\s{2,}", row.strip())
        return cells[:1] + cells[3:]

    assert [untimed(row) for row in listed[1:]] == [untimed(row) for row in table_shown[1:]]
    # revoked: the next request with it is 401 invalid_api_key
    assert ran("capyctl revoke key app1").stdout == shown("key app1 revoked")
    (refused,) = [done for block, done in runs if block.expect == "invalid_api_key"]
    assert msgspec.json.decode(refused.stdout) == msgspec.json.decode(shown('"code":"invalid_api_key"'))
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "Hello"}]}
    answer = httpx.post(
        capy.base_url + "/v1/chat/completions",
        json=chat,
        headers={"authorization": f"Bearer {kept['APP_KEY']}"},
        timeout=30,
    )
    assert answer.status_code == 401
    # a daily limit of 2: two answers, then 429 daily_limit with Retry-After to 00:00 UTC
    assert ran("for i in 1 2").stdout == shown("200\n200")
    head, _, body = ran("curl -si").stdout.replace("\r\n", "\n").partition("\n\n")
    doc_head, _, doc_body = shown("HTTP/1.1 429").partition("\n\n")
    assert head.splitlines()[0] == doc_head.splitlines()[0] == "HTTP/1.1 429 Too Many Requests"
    headers = dict(line.split(": ", 1) for line in head.splitlines()[1:])
    assert {line.split(": ", 1)[0] for line in doc_head.splitlines()[1:]} <= headers.keys()
    assert abs(int(headers["retry-after"]) - (86400 - time.time() % 86400)) < 5
    limited, doc_limited = msgspec.json.decode(body), msgspec.json.decode(doc_body)
    assert limited["error"].keys() == doc_limited["error"].keys()
    assert {k: v for k, v in limited["error"].items() if k != "message"} == {
        k: v for k, v in doc_limited["error"].items() if k != "message"
    }
    assert f"it may call again in {headers['retry-after']} s" in limited["error"]["message"]
    # a key scoped to smollm2: gpt-4o (deployed here) is not found, and /metrics is forbidden
    assert [m["id"] for m in msgspec.json.decode(ran("/v1/models").stdout)["data"]] == ["smollm2"]
    assert "gpt-4o" in capy.cli("list", "deployments").stdout
    for code in ("model_not_found", "forbidden", "cache_salt_unsupported", "invalid_request"):
        (done,) = [done for block, done in runs if block.expect == code]
        assert msgspec.json.decode(done.stdout) == msgspec.json.decode(shown(f'"code":"{code}"')), code
    assert (
        httpx.get(
            capy.base_url + "/metrics", headers={"authorization": f"Bearer {kept['BOT_KEY']}"}, timeout=10
        ).status_code
        == 403
    )
    # the management API: created with its secret, then revoked
    made, doc_made = (
        msgspec.json.decode(ran('-d \'{"name": "ci-runner"').stdout),
        msgspec.json.decode(shown('"name":"ci-runner"')),
    )
    assert made.keys() == doc_made.keys() and key_id(made["secret"]) == made["id"]
    assert {k: v for k, v in made.items() if k not in ("id", "created", "secret")} == {
        k: v for k, v in doc_made.items() if k not in ("id", "created", "secret")
    }
    assert msgspec.json.decode(ran("-X DELETE").stdout) == {"revoked": "ci-runner", "id": made["id"]}
    # the key's name in the log line (never its secret), its events, the metrics' key label
    line = r"\d\d:\d\d:\d\d request [0-9A-Z]{26} smollm2 -> \S+ instance 0 key app1"
    assert re.fullmatch(line, shown("instance 0 key app1").strip())
    assert re.search(line + "$", capy.log(), re.M)
    secrets_shown = [kept[name].split("_", 2)[2] for name in ("APP_KEY", "TRIAL_KEY", "BOT_KEY", "TENANT_KEY")]
    stored = b"".join(p.read_bytes() for p in capy.state_dir.glob("capyctl.db*"))
    assert not [s for s in secrets_shown if s in capy.log() or s.encode() in stored]
    events = [msgspec.json.decode(line) for line in ran("capyctl events --json").stdout.splitlines()]
    doc_events = [msgspec.json.decode(line) for line in shown('"kind":"key_created"').splitlines()]
    assert [e["kind"] for e in events] == [e["kind"] for e in doc_events] == ["key_created", "key_revoked"]
    for event, doc_event in zip(events, doc_events, strict=True):
        assert event["deployment"] is None and event["detail"]["key_id"] == app_id
        assert {**event["detail"], "key_id": None} == {**doc_event["detail"], "key_id": None}
    assert set(ran("grep '^capyctl_requests_total'").stdout.splitlines()) == set(
        shown('capyctl_requests_total{code="ok",deployment="smollm2",key="app1"}').splitlines()
    )


def test_decision_examples_run_as_documented(capy: CapyServer, tmp_path: Path) -> None:
    """decisions.md: its curl and typesafe-sdk examples against a decisions deployment named as in the page,
    on the stand-in engine as vLLM 0.32 (it answers decisions in vLLM's shape)."""
    from tests.fakes.standin_venv import make_standin_venv

    (tmp_path / "model").mkdir()
    capy.cli("engine", "add", str(make_standin_venv(tmp_path / "vllm-venv", "vllm", "0.32.0")), "--name", "vllm")
    (file,) = [b for b in blocks("yaml", "decisions.md") if b.mark == "needs"]
    document = load_yaml(file.text, "decisions.md")
    document["model"] = str(tmp_path / "model")
    path = tmp_path / "decider.yaml"
    path.write_bytes(msgspec.yaml.encode(document))
    capy.cli("deploy", "model", "--file", str(path))
    (curl,) = [b for b in blocks("sh", "decisions.md") if "curl " in b.text]
    answer = msgspec.json.decode(run_curl_block(curl, capy))
    assert set(answer["answers"]) == {"route", "angry", "urgency"} and answer["model"] == "my-decider"
    assert set(answer["capyctl"]["metrics"]) >= {"total_ms", "time_to_response_ms", "input_tokens"}
    (python,) = blocks("python", "decisions.md")
    code = on_server(python.text, capy).replace(
        'Path.home() / ".local/state/capyctl/identity/credentials"', f'Path("{capy.state_dir}/identity/credentials")'
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    choice, noul, score = done.stdout.splitlines()[0].split()
    assert choice in ("billing", "shipping", "technical") and 0 <= float(noul) <= 1 and 0 <= float(score) <= 2
    assert len(done.stdout.splitlines()[1]) == 26


def test_replay_demo_runs_as_documented(capy: CapyServer, tmp_path: Path) -> None:
    """replay.md's demo: a replay engine attached as `demo`, and the page's curl examples against it."""
    (demo,) = [b for b in blocks("yaml", "replay.md") if b.mark == "replay"]
    assert f"endpoint: {DOC_REPLAY}\n" in demo.text
    assert (
        f"capyctl-replay --recordings tests/contract/recordings/{demo.expect} --port 8100"
        in (DOCS / "replay.md").read_text()
    )
    replay = subprocess.Popen(
        [sys.executable, "-m", "capyctl.replay", "--recordings", str(RECORDINGS / str(demo.expect)), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        assert replay.stdout is not None
        banner = replay.stdout.readline().decode()
        found = re.search(r"listening on (http://\S+)", banner)
        assert found, f"the replay engine did not start: {banner}"
        path = tmp_path / "demo.yaml"
        path.write_text(demo.text.replace(DOC_REPLAY, found.group(1)))
        deployed = capy.cli_json("deploy", "model", "--file", str(path), "--wait")["deployment"]
        assert (deployed["state"], deployed["engine_version"], deployed["fields"]["verified"]) == (
            "ready",
            demo.expect.split("/")[1],
            True,
        )
        examples = [b for b in blocks("sh", "replay.md") if "curl " in b.text]
        assert len(examples) >= 4 and any(b.mark == "error" for b in examples)
        outputs = [run_curl_block(block, capy, found.group(1)) for block in examples]
        # the non-streamed answer is all recorded bytes and engine figures: the page shows it exactly
        (shown,) = [b for b in blocks("json", "replay.md") if '"chat.completion"' in b.text]
        assert msgspec.json.decode(outputs[0]) == msgspec.json.decode(shown.text)
    finally:
        replay.terminate()
        replay.wait(10)


def test_server_configuration_examples_check_as_marked(tmp_path: Path) -> None:
    """`config:` blocks are server configuration files; `capyctl config check` accepts or refuses them as marked."""
    examples = [b for b in blocks("yaml") if b.mark == "config"]
    assert any(b.expect == "valid" for b in examples) and any(b.expect != "valid" for b in examples)
    for i, block in enumerate(examples):
        path = tmp_path / f"config-{i}.yaml"
        path.write_text(block.text)
        done = subprocess.run(
            [sys.executable, "-m", "capyctl", "config", "check", str(path)], capture_output=True, text=True, timeout=60
        )
        where = f"{block.page}:\n{block.text}\n{done.stdout}{done.stderr}"
        if block.expect == "valid":
            assert done.returncode == 0 and done.stdout.startswith(f"{path}: valid"), where
        else:
            assert done.returncode == 6 and f"{path}: {block.expect}" in done.stderr, where


def test_other_yaml_blocks_are_what_they_say(tmp_path: Path) -> None:
    """`needs:` deployment files pass CapyCTL's checks for their family; `other:` blocks are YAML mappings."""
    needs = [b for b in blocks("yaml") if b.mark == "needs"]
    others = [b for b in blocks("yaml") if b.mark == "other"]
    assert needs and others
    for block in needs:
        spec = decode_spec(load_yaml(block.text, block.page))
        adapter = ADAPTERS[str(block.expect)]
        assert not spec.attached, block.text
        check_extra_args(spec.engine_config.extra_args, adapter.owned_options)
        check_env(spec.engine_config.env, adapter.owned_env)
    for block in others:
        assert isinstance(load_yaml(block.text, block.page), dict), block.text


def test_deployment_files_for_a_host_decode_and_name_it() -> None:
    examples = [b for b in blocks("yaml") if b.mark == "host"]
    assert examples
    for block in examples:
        spec = decode_spec(load_yaml(block.text, block.page))
        assert spec.host == block.expect and not spec.attached, f"{block.page}:\n{block.text}"


def test_documented_field_table_matches_the_code() -> None:
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]+) \| ([^|]+) \|", section("engines.md", "Verified streams"), re.M)
    documented = {label: (set(re.findall(r"`(\w+)`", keys)), provenance.strip()) for label, keys, provenance in rows}
    assert len(rows) == len(documented)
    assert documented == {row.label: (set(row.delta), str(row.provenance)) for row in FIELD_TABLE}


def test_documented_environment_matches_the_adapters() -> None:
    rows = re.findall(r"^\| `(\w+)` \| .*? \| .*? \| (.*?) \|$", section("engines.md", "Environment"), re.M)
    documented = {family: set(re.findall(r"`(\w+)`", refused)) for family, refused in rows}
    assert documented == {family: set(adapter.owned_env) for family, adapter in ADAPTERS.items()}


def test_documented_prometheus_metrics_match_a_scrape(served: CapyServer) -> None:
    scrape = httpx.get(served.base_url + "/metrics", headers=served.headers(), timeout=10).text
    exposed = {
        f.name + ("_total" if f.type == "counter" else ""): f
        for f in text_string_to_metric_families(scrape)
        if not f.name.endswith("_created")
    }
    rows = re.findall(
        r"^\| `(capyctl_\w+)` \| (\w+) \| (.*?) \|", section("observability.md", "Prometheus metrics"), re.M
    )
    assert {name for name, _, _ in rows} == set(exposed)
    for name, kind, labels in rows:
        assert exposed[name].type == kind, name
        seen = {label for sample in exposed[name].samples for label in sample.labels if label != "le"}
        assert not exposed[name].samples or seen == set(re.findall(r"`(\w+)`", labels)), name


def _kinds_in(arg: ast.expr, outcomes: set[str]) -> set[str]:
    """The event kinds an argument of ``emit`` can be: a string, either string of a conditional, or
    ``f"PREFIX{outcome}"`` with each outcome ``fleet.py`` sets."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.isidentifier():
        return {arg.value}
    if isinstance(arg, ast.IfExp):
        return _kinds_in(arg.body, outcomes) | _kinds_in(arg.orelse, outcomes)
    if isinstance(arg, ast.JoinedStr) and len(arg.values) == 2:
        prefix, value = arg.values
        named = isinstance(value, ast.FormattedValue) and ast.unparse(value.value) == "outcome"
        if isinstance(prefix, ast.Constant) and named:
            return {f"{prefix.value}{outcome}" for outcome in outcomes}
    return set()


def test_documented_event_kinds_match_the_code() -> None:
    services = {p.name: p.read_text() for p in (SRC / "services").glob("*.py")}
    kinds = {"router_selection", "router_failover"}  # (stored by Events itself, beside their log lines)
    assert '"router_selection"' in services["events.py"] and '"router_failover"' in services["events.py"]
    outcomes = set(re.findall(r'outcome = "(\w+)"', services["fleet.py"]))
    for text in services.values():  # every .emit(...) call, however it is laid out: the kinds it can name
        for call in ast.walk(ast.parse(text)):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "emit":
                for arg in call.args:
                    kinds |= _kinds_in(arg, outcomes)
    documented = set(re.findall(r"^\| `(\w+)` \|", section("observability.md", "Events"), re.M))
    assert documented == kinds


def test_python_example_runs(served: CapyServer) -> None:
    examples = blocks("python", "requests.md")
    assert examples
    for block in examples:
        done = subprocess.run(
            [sys.executable, "-c", on_server(block.text, served)], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        assert len([line for line in done.stdout.splitlines() if line.strip()]) >= 2, done.stdout  # reply, stream


def command_path(tokens: list[str]) -> tuple[list[str], list[str]]:
    """The subcommand path at the start of `tokens` (the words after `capyctl`), and the options used."""
    command, path = typer.main.get_command(app), []
    while len(path) < len(tokens) and tokens[len(path)] in getattr(command, "commands", {}):
        command = command.commands[tokens[len(path)]]
        path.append(tokens[len(path)])
    rest = tokens[len(path) :]
    is_group = hasattr(command, "commands")
    assert not is_group or rest[:1] and rest[0].startswith("-"), f"not a command: capyctl {' '.join(tokens)}"
    return path, [m.split("=")[0] for m in re.findall(r"(?<![\w-])--?[a-z][a-z-]*", " ".join(rest))]


def test_every_capyctl_command_line_exists_with_its_options() -> None:
    commands = []
    for block in blocks("sh"):
        for line in block.text.replace("\\\n", " ").splitlines():
            if line.startswith("capyctl "):
                commands.append((block.page, line))
            # a command whose output a variable keeps: APP_KEY=$(capyctl create key app1 ...)
            commands += [(block.page, inner) for inner in re.findall(r"\$\((capyctl [^)]*)\)", line)]
    assert len(commands) >= 15 and any(page == "cli.md" for page, _ in commands)
    for page, line in commands:
        path, options = command_path(shlex.split(line)[1:])
        done = subprocess.run(
            [sys.executable, "-m", "capyctl", *path, "--help"],
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "200"},
            timeout=60,
        )
        assert done.returncode == 0, f"{page}: {line}\n{done.stderr}"
        assert f"capyctl {' '.join(path)}".strip() in done.stdout, f"{page}: {line}"
        for option in options:
            assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", done.stdout), f"{page}: {line}: no {option}"


TOOLS = {  # other programs the pages run, and how the test asks for their --help
    "capyctl-replay": [sys.executable, "-m", "capyctl.replay"],
    "python -m capyctl.replay": [sys.executable, "-m", "capyctl.replay"],
    "python bench/relay.py": [sys.executable, "bench/relay.py"],
    "python bench/ab_ttft.py": [sys.executable, "bench/ab_ttft.py"],
    "python bench/cold.py": [sys.executable, "bench/cold.py"],
    "python bench/soak.py": [sys.executable, "bench/soak.py"],
    "python bench/streams.py": [sys.executable, "bench/streams.py"],
    "python bench/dashboard.py": [sys.executable, "bench/dashboard.py"],
    "python -m pytest": [sys.executable, "-m", "pytest"],
    ".venv/bin/ruff check": [sys.executable, "-m", "ruff", "check"],
    ".venv/bin/ruff format": [sys.executable, "-m", "ruff", "format"],
    ".venv/bin/mypy": [sys.executable, "-m", "mypy"],
}


def test_other_command_lines_exist_with_their_options() -> None:
    lines = [(b.page, line) for b in blocks("sh") for line in b.text.replace("\\\n", " ").splitlines()]
    checked = 0
    for page, line in lines:
        for prefix, argv in TOOLS.items():
            if not (line == prefix or line.startswith(prefix + " ")):
                continue
            rest = shlex.split(line[len(prefix) :])
            # pytest's options depend on the conftest files of the paths it is given
            paths = [w for w in rest if "pytest" in prefix and not w.startswith("-") and (ROOT / w).exists()]
            done = subprocess.run(
                [*argv, *paths, "--help"],
                capture_output=True,
                text=True,
                cwd=ROOT,
                env={**os.environ, "COLUMNS": "200"},
                timeout=120,
            )
            assert done.returncode == 0, f"{page}: {line}\n{done.stderr}"
            for option in re.findall(r"(?<![\w-])--?[a-z][a-z-]*", " ".join(rest)):
                found = re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", done.stdout)
                assert found, f"{page}: {line}: no {option}"
            checked += 1
    assert checked >= 5


def test_documented_exit_codes_match_the_cli() -> None:
    documented: dict[str, int] = {}
    for status, codes in re.findall(r"^\| (\d) \| (.*?) \|", (DOCS / "cli.md").read_text(), re.M):
        for code in re.findall(r"`([\w-]+)`", codes):
            documented[code] = int(status)
    assert documented == EXIT_CODES
    assert re.search(r"^\| 1 \| \| any other", (DOCS / "cli.md").read_text(), re.M)


def test_documented_statuses_match_the_http_table() -> None:
    text = (DOCS / "errors.md").read_text()
    codes_section = text.split("\n## Codes\n")[1].split("\n## ")[0]
    rows = [line for line in codes_section.splitlines() if line.startswith("| `")]
    found = [re.match(r"^\| `([\w-]+)` \| (\d{3}) \| .+ \|$", row) for row in rows]
    assert all(found), [row for row, match in zip(rows, found, strict=False) if not match]
    assert {m.group(1): int(m.group(2)) for m in found if m} == STATUS
    extra_section = text.split("\n## Extra fields\n")[1].split("\n## ")[0]
    assert set(re.findall(r"^\| `([\w-]+)` \|", extra_section, re.M)) <= set(STATUS)


def test_the_streamed_request_path_names_every_file_a_request_runs_code_in() -> None:
    """development.md's path of a streamed request names each file of src/ that has code run while one is
    served (bench/request_path.py traces a real one through a real server), and names no file that is gone."""
    page = (DOCS / "development.md").read_text()
    section = page[page.index("## The path of a streamed request") : page.index("### Why CapyCTL serves HTTP itself")]
    named = set(re.findall(r"`((?:adapters|services|domain)/[\w/]+\.py)`", section))
    assert named and all((ROOT / "src" / "capyctl" / name).is_file() for name in named), named
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "request_path.py"), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    traced = set(msgspec.json.decode(done.stdout.strip().splitlines()[-1]))
    assert {"adapters/http/server.py", "adapters/engines/_wire.py", "domain/relay_check.py"} <= traced
    assert traced - named == set(), (
        f"files a streamed request runs code in that the page does not name: {traced - named}"
    )
