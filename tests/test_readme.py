"""The README's transcripts, run on a real kernel: each printed line has the README's shape.

A transcript is a ```text block with `In [n]:` prompts. The HTML comment just before
it says how it runs (GitHub does not show it):

- `<!-- test: session NAME -->`: its cells run, in README order, in the kernel of that
  session (one kernel a name, after the setup cells of `SETUP[NAME]`, not compared);
- `<!-- test: gpu -->`: it needs a GPU and is skipped here;
- `<!-- test: elided -->`: a cell's code is left out (`...`), so it cannot run.

Figures are masked (numbers with their units, `n/a`, a lone `-`, temporary paths),
runs of spaces and dashes squeezed, blank lines dropped. A README line `...` stands for
any lines. Where the README shows no report line after a cell, the kernel's is dropped.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import pytest
from kernel import ROOT, execute, notebook, texts

pytestmark = pytest.mark.slow

README = ROOT / "README.md"
SKIPPED = {"gpu": "the transcript needs a GPU", "elided": "a cell's code is left out (...)"}
SETUP = {
    "quickstart": [],
    "live": ["%load_ext torch_device_magic"],  # the live line's transcript
    "nograd": ["%load_ext torch_device_magic\nimport torch\n"
               "model = torch.nn.Linear(1024, 1024)\nx = torch.randn(8, 1024)"],
    "profile": ["%load_ext torch_device_magic\nimport torch\n"
                "model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), "
                "torch.nn.Linear(1024, 10))\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                "x = torch.randn(512, 1024)\ny = torch.randint(0, 10, (512,))"],
}

FENCE = re.compile(r"^( *)```text\n(.*?)^ *```$", re.M | re.S)
MARK = re.compile(r"<!-- test: (session (\w+)|gpu|elided) -->\s*$")
PROMPT = re.compile(r"^In \[\d+\]: (.*)$")
MORE = re.compile(r"^ *\.\.\.: ?(.*)$")
FIGURE = re.compile(
    r"(?<![\w.])[+-]?\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?[kMG]?"
    r"(?: ?(?:µs|ms|s|min|B|KiB|MiB|GiB|TiB|%|×))?(?![\w.])"
)


@dataclass
class Cell:
    source: str
    shown: list[str]  # the lines the README shows under it


@dataclass
class Transcript:
    heading: str
    mark: str | None  # "gpu", "elided", "session NAME" or None (unmarked)
    cells: list[Cell]

    @property
    def session(self) -> str | None:
        return self.mark.split()[1] if self.mark and self.mark.startswith("session") else None


def transcripts() -> list[Transcript]:
    text = README.read_text(encoding="utf-8")
    found = []
    for block in FENCE.finditer(text):
        indent, body = len(block.group(1)), block.group(2)
        lines = [line[indent:] for line in body.splitlines()]
        if not any(PROMPT.match(line) for line in lines):
            continue  # not a transcript (a traceback, a shell command)
        before = text[: block.start()]
        mark = MARK.search(before.rstrip() + "\n")
        heading = re.findall(r"^#+ (.*)$", before, re.M)[-1]
        cells: list[Cell] = []
        for line in lines:
            if prompt := PROMPT.match(line):
                cells.append(Cell(prompt.group(1), []))
            elif (more := MORE.match(line)) and not cells[-1].shown:
                cells[-1].source += "\n" + more.group(1)
            else:
                cells[-1].shown.append(re.sub(r"^Out\[\d+\]: ", "", line))
        found.append(Transcript(heading, mark and mark.group(1), cells))
    return found


def shape(line: str) -> str:
    """A line with its figures masked and its runs of spaces and dashes squeezed."""
    line = re.sub(r"/tmp/\S+", "<path>", line.strip())
    line = re.sub(r"\btorch \d\S*", "torch <version>", line)
    line = FIGURE.sub("<n>", line)
    line = re.sub(r"(?<!\S)(?:n/a|-)(?!\S)", "<n>", line)
    line = re.sub(r"-{2,}", "--", line)
    line = re.sub(r"^(slowest: line <n>.*? of the wall): .*", r"\1: <line>", line)  # timing's
    return re.sub(r" {2,}", " ", line)


def matches(expected: list[str], actual: list[str]) -> bool:
    """`expected` (with `...` for any lines) against `actual`, line by line."""
    if not expected:
        return not actual
    if expected[0] == "...":
        return any(matches(expected[1:], actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and expected[0] == actual[0] and matches(expected[1:], actual[1:])


@functools.cache
def session(name: str) -> list[list[str]]:
    """Each cell's printed lines, README cells of session `name` run in one kernel."""
    sources = [c.source for t in transcripts() if t.session == name for c in t.cells]
    nb = notebook(*SETUP[name], *sources)
    execute(nb, timeout=300)
    return [texts(cell).splitlines() for cell in nb.cells[len(SETUP[name]):]]


ALL = transcripts()


def test_every_transcript_is_marked_and_its_magic_lines_carry_no_comment():
    for transcript in ALL:
        assert transcript.mark is not None, f"mark the transcript under {transcript.heading!r}"
        assert transcript.session is None or transcript.session in SETUP, transcript.mark
        for cell in transcript.cells:
            # a magic takes `# ...` as its arguments: a comment there is a user's error
            magic_lines = [ln for ln in cell.source.splitlines() if ln.startswith("%")]
            assert not any(" #" in ln for ln in magic_lines), cell.source


@pytest.mark.parametrize("transcript", ALL, ids=lambda t: t.heading.split(":")[0].strip("`"))
def test_the_transcript_prints_what_the_readme_shows(transcript):
    if transcript.session is None:
        pytest.skip(SKIPPED.get(transcript.mark or "", "unmarked"))
    name = transcript.session
    ran = session(name)
    first = sum(len(t.cells) for t in ALL[: ALL.index(transcript)] if t.session == name)
    for cell, printed in zip(transcript.cells, ran[first:]):
        if not any(line.startswith("time ") for line in cell.shown):
            printed = [line for line in printed if not line.startswith("time ")]
        expected = [shape(line) for line in cell.shown if line.strip()]
        actual = [shape(line) for line in printed if line.strip()]
        assert matches(expected, actual), (
            f"{cell.source!r} printed\n" + "\n".join(actual)
            + "\nand the README shows\n" + "\n".join(expected)
        )
