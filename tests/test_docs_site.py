"""The documentation as a site: it builds strictly, its Python examples run, and every page
opens with what it is for and an example.

- ``mkdocs build --strict`` passes: no broken link or anchor, no API reference (``::: name``)
  that cannot be resolved (mkdocs.yml, tools/docs_site.py).
- Every ```` ```python ```` block of README.md and docs/*.md runs, against a real node started
  for its page (``deltaflow serve --engine delta-rs`` on a free port, its warehouse a
  temporary directory): in each block ``127.0.0.1:7700`` becomes the node's address and
  ``/data/wh`` its warehouse, the node and warehouse the examples assume (the README says so
  above its list of pages). A page's blocks run in order, in one namespace, in a fresh Python
  process whose working directory is a temporary one, as a reader would run that page alone;
  a block with a top-level ``await`` runs on the page's event loop. A page whose blocks use
  Spark runs in the test's own process instead, on the run's one SparkSession (a reader's
  ``getOrCreate()`` and ``get_spark()`` return it; a JVM per page would cost half a minute).
  A block whose first line
  names a module file (``# myapp/receivers.py``) is also written there, on the node's
  ``PYTHONPATH``, and the receivers it defines are allowed on the node (``--receiver``).
- What a page says a block prints is checked against what it printed: a ``print(...)`` line
  whose comment is a literal (``print(rows)  # [{'n': 1000}]``) needs a line equal to it; the
  code spans of an "It prints `...`" sentence right after the block must each appear (``...``
  standing for any text). The examples' node is ``n1``, as the pages say.
- A block is skipped only when the line before it (blank lines aside, and an HTML comment such
  as ``<!-- read-back -->``) is ``<!-- docs-test: skip: REASON -->``; the reason is required.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from deltaflow.testing import free_port

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Pages that need not open with an example: the roadmap is a list of work.
NO_OPENING_EXAMPLE = {"roadmap.md"}

FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
SKIP = re.compile(r"^\s*<!--\s*docs-test:\s*skip\b:?(.*?)-->\s*$")
COMMENT = re.compile(r"^\s*<!--.*-->\s*$")
#: A node or host address a block would reach (``"10.0.0.5:7700"``), not a URL's
#: (``spark://10.0.0.5:7077`` only configures a session that a block may never start).
IP_ADDRESS = re.compile(r"(?<![/\w.])\d{1,3}(?:\.\d{1,3}){3}\b")
MODULE_FILE = re.compile(r"^#\s*([A-Za-z_][\w/]*\.py)\s*$")
PRINT_SAYS = re.compile(r"^\s*print\(.*\)\s+#\s*(.+?)\s*$")
SPARK = re.compile(r"\bpyspark\b|\bspark_integration\b")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@dataclass(frozen=True)
class Block:
    """A Python block of a page: its number among the page's Python blocks, from 1."""

    page: str
    number: int
    line: int
    code: str
    skip: str | None  # the reason given, "" for a marker without one; None: it runs
    told: tuple[str, ...] = ()  # the spans of the "It prints `...`" sentence after it

    def said_outputs(self) -> list[object]:
        """The literal of each ``print`` line's comment (its text when it holds a call, such
        as ``Decimal('9.99')``); a comment that is not a literal is a remark."""
        said: list[object] = []
        for line in self.code.splitlines():
            if (match := PRINT_SAYS.match(line)) is None:
                continue
            try:
                tree = ast.parse(match[1], mode="eval")
            except SyntaxError:  # a remark, not an output
                continue
            if isinstance(tree.body, (ast.List, ast.Dict, ast.Tuple, ast.Set, ast.Constant)):
                try:
                    said.append(ast.literal_eval(tree))
                except ValueError:
                    said.append(match[1])
        return said

    @property
    def name(self) -> str:
        return f"{self.page}, Python block {self.number} (line {self.line})"

    def check_prints(self, output: str) -> None:
        """Each output the block is said to print is in ``output``: a literal as one of its
        lines; a span of the sentence after it anywhere, ``...`` standing for any text."""
        lines: list[object] = []
        for text in output.splitlines():
            lines.append(text)
            with contextlib.suppress(ValueError, SyntaxError):
                lines.append(ast.literal_eval(text))
        for said in self.said_outputs():
            assert said in lines, (
                f"{self.name} says it prints {said!r}; it printed:\n{output[-3000:]}"
            )
        for span in self.told:
            pattern = ".*?".join(
                r"\s+".join(map(re.escape, piece.split())) for piece in span.split("...")
            )
            assert re.search(pattern, output, re.DOTALL), (
                f"the text after {self.name} says it prints `{span}`; it printed:\n{output[-3000:]}"
            )

    @property
    def module_file(self) -> str | None:
        """The file the block says it is (``# myapp/receivers.py`` as its first line)."""
        first = self.code.split("\n", 1)[0]
        match = MODULE_FILE.match(first)
        return match[1] if match else None


def python_blocks(path: Path) -> list[Block]:
    """The page's ```` ```python ```` blocks (indented ones dedented), with their skip marks."""
    lines = path.read_text(encoding="utf-8").splitlines()
    page = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        indent, lang = fence[1], fence[2]
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        if lang == "python":
            code = "\n".join(line.removeprefix(indent) for line in lines[i + 1 : end])
            told = told_prints(lines, end + 1)
            blocks.append(
                Block(page, len(blocks) + 1, i + 1, code + "\n", skip_reason(lines, i), told)
            )
        i = end + 1
    return blocks


def told_prints(lines: list[str], after: int) -> tuple[str, ...]:
    """The code spans of the first sentence of the paragraph after a block, when it opens
    with "It prints" (the sentence ends at a ``.`` or ``:`` outside the spans)."""
    j = after
    while j < len(lines) and not lines[j].strip():
        j += 1
    paragraph: list[str] = []
    while j < len(lines) and lines[j].strip():
        paragraph.append(lines[j].strip())
        j += 1
    text = " ".join(paragraph)
    if not text.startswith("It prints"):
        return ()
    parts = text.split("`")
    spans: list[str] = []
    for k, part in enumerate(parts):
        if k % 2:
            spans.append(part)
        elif re.search(r"[.:](\s|$)", part):
            break
    return tuple(spans)


def skip_reason(lines: list[str], fence: int) -> str | None:
    """The reason of the ``docs-test: skip`` mark before the block opening at ``fence``."""
    j = fence - 1
    while j >= 0 and (not lines[j].strip() or COMMENT.match(lines[j])) and not SKIP.match(lines[j]):
        j -= 1
    mark = SKIP.match(lines[j]) if j >= 0 else None
    return mark[1].strip() if mark else None


def receivers_of(code: str, module: str) -> list[str]:
    """``module.Class`` of each class in ``code`` that subclasses a ``Receiver``."""
    return [
        f"{module}.{node.name}"
        for node in ast.parse(code).body
        if isinstance(node, ast.ClassDef)
        and any(ast.unparse(base).split(".")[-1] == "Receiver" for base in node.bases)
    ]


ALL_BLOCKS = [block for page in PAGES for block in python_blocks(page)]
RUNNABLE_PAGES = list(dict.fromkeys(b.page for b in ALL_BLOCKS if b.skip is None))
#: The node and warehouse the examples assume, replaced by the test's.
DOCS_ADDRESS, DOCS_WAREHOUSE = "127.0.0.1:7700", "/data/wh"


@dataclass(frozen=True)
class DocsNode:
    address: str
    warehouse: Path
    modules: Path  # the module files of the page's blocks, the node's PYTHONPATH


@contextlib.contextmanager
def docs_node(blocks: list[Block], base: Path) -> Iterator[DocsNode]:
    """A fresh node for one page's examples, allowed the receivers the page defines in files;
    stopped by its pid (SIGTERM, then SIGKILL)."""
    warehouse, modules = base / "wh", base / "modules"
    receivers = []
    modules.mkdir(parents=True)
    for block in blocks:
        if (file := block.module_file) is not None:
            (modules / file).parent.mkdir(parents=True, exist_ok=True)
            (modules / file).write_text(block.code, encoding="utf-8")
            module = file.removesuffix(".py").replace("/", ".")
            receivers += [f"--receiver={name}" for name in receivers_of(block.code, module)]
    port = free_port()
    log = base / "node.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "deltaflow.cli", "serve", "--engine", "delta-rs"),
                *("--node-id", "n1", "--port", str(port), "--warehouse", str(warehouse)),
                *receivers,
            ],
            cwd=modules,
            env={**os.environ, "PYTHONPATH": str(modules)},
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 90
        while "ready on" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield DocsNode(f"127.0.0.1:{port}", warehouse, modules)
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


#: Runs one page's blocks in order, in one namespace (a fresh ``__main__``): argv[1] is a JSON
#: list of [number, code]. A block with a top-level ``await`` runs on one event loop.
RUNNER = """
import ast, asyncio, inspect, json, linecache, sys, traceback, types

main = types.ModuleType("__main__")
sys.modules["__main__"] = main
loop = asyncio.new_event_loop()
for number, code in json.load(open(sys.argv[1])):
    print(f"--- block {number}", flush=True)
    name = f"<block {number}>"
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)  # in tracebacks
    try:
        compiled = compile(code, name, "exec", ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        if compiled.co_flags & inspect.CO_COROUTINE:
            loop.run_until_complete(eval(compiled, main.__dict__))
        else:
            exec(compiled, main.__dict__)
    except BaseException:
        traceback.print_exc()
        print(f"FAILED block {number}", file=sys.stderr, flush=True)
        sys.exit(1)
"""


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """A broken link, a missing anchor or an API reference that does not resolve fails."""
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "index.html").exists() and (tmp_path / "benchmarks" / "index.html").exists()
    reference = (tmp_path / "reference" / "client" / "index.html").read_text(encoding="utf-8")
    assert 'id="deltaflow.StreamerOptions"' in reference


@pytest.mark.parametrize(
    "block", [b for b in ALL_BLOCKS if b.skip is not None], ids=lambda b: f"{b.page}-{b.number}"
)
def test_a_skipped_block_says_why(block: Block) -> None:
    """Each skipped block is listed as a skipped test, with its reason."""
    assert block.skip, f"{block.name}: say why it is skipped: <!-- docs-test: skip: REASON -->"
    pytest.skip(f"{block.name}: {block.skip}")


def test_the_block_finder_reads_marks_and_indented_blocks(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- docs-test: skip: needs a cluster -->\n\n```python\na = 1\n```\n\n"
        "<!-- docs-test: skip: why -->\n<!-- read-back -->\n```python\nb = 2\n```\n\n"
        "```sh\nls\n```\n- a list:\n\n  ```python\n  c = 3\n  ```\n"
        "<!-- docs-test: skip -->\n```python\nd = 4\n```\n"
    )
    found = python_blocks(page)
    assert [(b.code, b.skip) for b in found] == [
        ("a = 1\n", "needs a cluster"),
        ("b = 2\n", "why"),
        ("c = 3\n", None),
        ("d = 4\n", ""),
    ]


def test_a_block_is_held_to_what_it_says_it_prints(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nprint(rows)  # [{'n': 1000}]\nprint(x)  # the table is made later\n"
        "print(d)  # [Decimal('9.99')]\nprint(len(rows))  # 3\n```\n\n"
        "It prints `one ... two`, then `three\nfour`: not `five`.\n"
    )
    [block] = python_blocks(page)
    assert block.said_outputs() == [[{"n": 1000}], "[Decimal('9.99')]", 3]  # remarks skipped
    assert block.told == ("one ... two", "three four")
    block.check_prints("[{'n': 1000}]\n[Decimal('9.99')]\n3\none, and two\nthree\nfour\n")
    with pytest.raises(AssertionError, match=r"says it prints \[\{'n': 1000\}\]"):
        block.check_prints("[{'n': 999}]\n[Decimal('9.99')]\n3\none two\nthree four\n")
    with pytest.raises(AssertionError, match="says it prints `three four`"):
        block.check_prints("[{'n': 1000}]\n[Decimal('9.99')]\n3\none two\nthree five\n")
    assert printed_by_block("--- block 1\na\n--- block 3\nb\nc\n") == {1: "a\n", 3: "b\nc\n"}


def run_here(blocks: list[tuple[int, str]], page: str) -> dict[int, str]:
    """The blocks in order in one namespace, in this process (a page that uses Spark); what
    each printed."""
    import io
    import traceback

    namespace: dict[str, object] = {"__name__": "__main__"}
    printed: dict[int, str] = {}
    for number, code in blocks:
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(code, f"<{page} block {number}>", "exec"), namespace)
        except Exception:
            pytest.fail(f"{page}, Python block {number}:\n{traceback.format_exc()[-5000:]}")
        printed[number] = out.getvalue()
    return printed


def printed_by_block(stdout: str) -> dict[int, str]:
    """The runner's output cut at its ``--- block N`` lines."""
    parts = re.split(r"^--- block (\d+)\n", stdout, flags=re.MULTILINE)
    return {int(number): text for number, text in zip(parts[1::2], parts[2::2], strict=True)}


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_the_python_blocks_of_a_page_run(
    page: str, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page's blocks in order, against a node of their own, as a reader would run them."""
    blocks = [b for b in ALL_BLOCKS if b.page == page and b.skip is None]
    for block in blocks:  # the examples reach this machine's test node, nothing else
        elsewhere = set(IP_ADDRESS.findall(block.code)) - {"127.0.0.1"}
        assert not elsewhere, f"{block.name} reaches {elsewhere}: use 127.0.0.1:7700, or skip it"
    with docs_node(blocks, tmp_path / "node") as node:
        codes = [
            (
                b.number,
                b.code.replace(DOCS_ADDRESS, node.address).replace(
                    DOCS_WAREHOUSE, str(node.warehouse)
                ),
            )
            for b in blocks
        ]
        if any(SPARK.search(code) for _, code in codes):
            request.getfixturevalue("spark")  # the run's session, started on first use
            monkeypatch.chdir(tmp_path)
            monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # a block's mkdtemp()
            check_what_blocks_print(blocks, run_here(codes, page))
            return
        (tmp_path / "blocks.json").write_text(json.dumps(codes))
        (tmp_path / "run.py").write_text(RUNNER)
        run = subprocess.run(
            [sys.executable, "run.py", "blocks.json"],
            cwd=tmp_path,
            env={
                **os.environ,
                "SPARK_LOCAL_IP": "127.0.0.1",
                "PYTHONPATH": str(node.modules),
                "TMPDIR": str(tmp_path),
            },
            capture_output=True,
            text=True,
            timeout=240,
        )
    failed = re.search(r"FAILED block (\d+)", run.stderr)
    which = next((b.name for b in blocks if failed and b.number == int(failed[1])), page)
    assert run.returncode == 0, (
        f"{which}: exit {run.returncode}\n--- stdout:\n{run.stdout[-3000:]}\n"
        f"--- stderr:\n{run.stderr[-5000:]}"
    )
    check_what_blocks_print(blocks, printed_by_block(run.stdout))


def check_what_blocks_print(blocks: list[Block], printed: dict[int, str]) -> None:
    for block in blocks:
        block.check_prints(printed.get(block.number, ""))


@pytest.mark.parametrize(
    "page",
    [
        str(p.relative_to(ROOT / "docs"))
        for p in [*PAGES[1:], *sorted((ROOT / "docs" / "internals").glob("*.md"))]
        if p.name not in NO_OPENING_EXAMPLE
    ],
)
def test_every_page_opens_with_what_it_is_for_and_an_example(page: str) -> None:
    """Before its first ``## `` heading a page says what it is for and shows a code block (the
    how-it-works pages of docs/internals/ too)."""
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    opening = re.split(r"^## ", text, maxsplit=1, flags=re.MULTILINE)[0]
    prose = re.sub(r"^\s*```.*?^\s*```", "", opening, flags=re.MULTILINE | re.DOTALL)
    assert prose.split("\n", 1)[-1].strip(), f"docs/{page} opens with no words on what it is for"
    assert re.search(r"^\s*```", opening, re.MULTILINE), (
        f"docs/{page} shows no example before its first '## ' heading"
    )
