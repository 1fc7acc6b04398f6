"""The executed demo's HTML rendering, opened in headless Chromium: the extension's HTML
output is really displayed (present, visible, not covered, with size and readable text)."""

from __future__ import annotations

import re

import pytest
from browser import Chromium, find_chromium
from kernel import ROOT

pytestmark = pytest.mark.slow

# what every HTML output of each kind must read, once displayed
EXPECTED = {
    ".tdm-table": re.compile(r"\w"),  # the tables of %device, moves, %%gpumem, %devhistory
    ".tdm-report": re.compile(r"^time \d"),  # the line after each cell
}

MEASURE = """
(() => {
  const rgba = (c) => (c.match(/[\\d.]+/g) || []).map(Number).concat([1]).slice(0, 4);
  const lum = (rgb) => rgb.map((v) => v / 255)
    .map((v) => (v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4))
    .reduce((sum, v, i) => sum + v * [0.2126, 0.7152, 0.0722][i], 0);
  return [...document.querySelectorAll(SELECTOR)].map((el) => {
    el.scrollIntoView({block: "center"});
    const box = el.getBoundingClientRect();
    const hit = document.elementFromPoint(
      box.left + Math.min(box.width / 2, 40), box.top + Math.min(box.height / 2, 10));
    let opacity = 1, background = null;
    for (let e = el; e; e = e.parentElement) {
      const s = getComputedStyle(e);
      opacity *= Number(s.opacity);
      const bg = rgba(s.backgroundColor);
      if (!background && bg[3] > 0) background = bg;
    }
    background = background || [255, 255, 255, 1];
    const style = getComputedStyle(el), color = rgba(style.color);
    const alpha = color[3] * opacity;
    const shown = color.slice(0, 3).map((v, i) => v * alpha + background[i] * (1 - alpha));
    const [hi, lo] = [lum(shown), lum(background.slice(0, 3))].sort((a, b) => b - a);
    return {
      width: box.width, height: box.height, text: el.innerText.trim(),
      visible: el.checkVisibility({checkOpacity: true, checkVisibilityCSS: true}),
      on_top: el.contains(hit), font_px: parseFloat(style.fontSize),
      contrast: (hi + 0.05) / (lo + 0.05),
    };
  });
})()
"""


@pytest.fixture(scope="module")
def demo_html(request):
    pytest.importorskip("nbconvert", reason="nbconvert renders the HTML (pip install .[test])")
    from kernel import write_html

    nb, failed = request.getfixturevalue("demo")
    assert failed is None, failed
    return write_html(nb, ROOT / "out" / "demo.html")


@pytest.fixture(scope="module")
def page(demo_html, tmp_path_factory):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium; "
                    "python3 scripts/dev.py test installs it)")
    profile = tmp_path_factory.mktemp("chromium-profile")
    with Chromium(chromium, profile, size=(1280, 900), timeout_s=60) as browser:
        browser.open(demo_html.as_uri())
        yield browser


@pytest.mark.parametrize("selector", sorted(EXPECTED))
def test_the_extensions_html_is_displayed_and_readable(page, selector):
    found = page.evaluate(MEASURE.replace("SELECTOR", repr(selector)))
    assert found, f"no {selector} element in the demo's HTML rendering"
    for element in found:
        assert element["visible"] and element["on_top"], element
        assert element["width"] > 0 and element["height"] > 0, element
        assert element["font_px"] >= 9 and element["contrast"] >= 4.5, element
        assert EXPECTED[selector].search(element["text"]), element


# Columns of text and of numbers in the demo's tables: %tensors, %%profile's line and op tables.
TEXT_COLUMNS = {"name", "kind", "code", "op"}
NUMBER_COLUMNS = {"bytes", "hits", "wall", "calls"}
ALIGNMENT = """
[...document.querySelectorAll(".tdm-table table")].flatMap((table) =>
  [...table.querySelectorAll("thead th")].map((th, i) => ({
    header: th.innerText.trim(),
    aligns: [th, ...table.querySelectorAll(`tbody tr > td:nth-child(${i + 1})`)]
      .map((cell) => getComputedStyle(cell).textAlign),
  })))
"""


def test_text_columns_align_left_and_numbers_right_under_jupyterlabs_css(page):
    # nbconvert's lab template carries JupyterLab's CSS, which right-aligns every table
    # cell (`:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon td`): ours must win.
    assert page.evaluate('!!document.querySelector(".jp-RenderedHTMLCommon")')
    columns = page.evaluate(ALIGNMENT)
    seen = {c["header"] for c in columns}
    assert seen >= TEXT_COLUMNS | NUMBER_COLUMNS, seen
    for column in columns:
        if column["header"] in TEXT_COLUMNS:
            assert set(column["aligns"]) == {"left"}, column
        if column["header"] in NUMBER_COLUMNS:
            assert set(column["aligns"]) == {"right"}, column


def test_a_screenshot_is_saved_next_to_the_executed_notebook(page):
    png = page.screenshot(ROOT / "out" / "demo.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (png.parent / "demo.ipynb").exists()


# Long cells with the live line (its delay made small): in the rendered page each shows its
# report once, no live line text is left, and no output box is visible without text (the
# live display that a cell printed under is emptied, and an empty output takes no room).
LIVE_CELLS = (
    "import time\nfor i in range(3):\n    time.sleep(0.3)",
    "import time\nprint('a')\ntime.sleep(0.6)\nprint('b')",
)
LIVE_OUTPUTS = """
[...document.querySelectorAll(".jp-CodeCell")].slice(1).map((cell) => ({
  reports: cell.querySelectorAll(".tdm-report").length,
  live: cell.querySelectorAll(".tdm-live").length,
  text: cell.querySelector(".jp-Cell-outputWrapper").innerText,
  boxes: [...cell.querySelectorAll(".jp-OutputArea-output")].map((out) => ({
    height: out.getBoundingClientRect().height, text: out.innerText.trim(),
  })),
}))
"""


@pytest.fixture(scope="module")
def live_page(tmp_path_factory):
    pytest.importorskip("nbconvert", reason="nbconvert renders the HTML (pip install .[test])")
    from kernel import execute, notebook, write_html

    chromium = find_chromium()
    if chromium is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium)")
    setup = "%load_ext torch_device_magic\n%config TorchDeviceMagics.live_delay = 0.2"
    nb = execute(notebook(setup, *LIVE_CELLS), timeout=120)
    folder = tmp_path_factory.mktemp("live")
    html = write_html(nb, folder / "live.html")
    with Chromium(chromium, folder / "profile", size=(1280, 900), timeout_s=60) as browser:
        browser.open(html.as_uri())
        yield browser


def test_a_long_cells_page_shows_its_report_once_and_nothing_of_the_live_line(live_page):
    cells = live_page.evaluate(LIVE_OUTPUTS)
    assert len(cells) == len(LIVE_CELLS), cells
    for cell in cells:
        assert cell["reports"] == 1 and cell["live"] == 0, cell
        assert "running" not in cell["text"] and cell["text"].count("time ") == 1, cell
        for box in cell["boxes"]:  # an emptied display takes no room on the page
            assert box["text"] or box["height"] == 0, cell
    printed = cells[1]
    assert [b["text"] for b in printed["boxes"] if b["text"]][:2] == ["a", "b"], printed
    assert len(printed["boxes"]) == 4, printed  # a, the emptied live display, b, the report
    for element in live_page.evaluate(MEASURE.replace("SELECTOR", repr(".tdm-report"))):
        assert element["visible"] and element["on_top"] and element["height"] > 0, element
