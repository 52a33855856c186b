"""`mqinfer report costs --html FILE`: one self-contained page with the tables and the five charts
as inline SVG, over rows from a real `mqinfer run`; opened in headless Chromium when one is
installed (on PATH, or CHROME_BIN), which must lay out every chart with visible marks."""

from __future__ import annotations

import html.parser
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from mqinfer.ops.report import cost_report
from mqinfer.ops.report_html import CHARTS, render_html
from tests import zygote
from tests.helpers import clean_env, mqinfer_cmd, write_jsonl

SVG = "{http://www.w3.org/2000/svg}"
BUDGETS = '[metadata.team]\nads = 0.000001\nmaps = 100\n[tenants]\nacme = 1000\n'


def chromium() -> str | None:
    for name in (os.environ.get("CHROME_BIN"), "chromium", "chromium-browser", "google-chrome",
                 "chromium-headless-shell", "headless_shell"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("html")
    items = [{"id": f"r{i}", "prompt_token_ids": [5 + (i + k) % 200 for k in range(4 + 30 * (i % 3))],
              "max_tokens": 4 + 6 * (i % 4), "temperature": 0, "ignore_eos": True, "tenant": ("acme", "beta")[i % 2],
              "metadata": {"team": ("search", "ads", "maps", "<b>&co</b>")[i % 4]}} for i in range(20)]
    src = write_jsonl(tmp / "in.jsonl", items)
    env = clean_env("OMP_NUM_THREADS")
    proc = zygote.run([sys.executable, "-m", "mqinfer", "run", str(src), "--out", str(tmp / "out"),
                       "--workers", "1", "--price-per-device-hour", "36"],
                      env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (tmp / "budgets.toml").write_text(BUDGETS)
    return tmp


@pytest.fixture(scope="module")
def page(out):
    path = out / "report.html"
    proc = zygote.run(mqinfer_cmd("report", "costs", str(out / "out"), "--by", "metadata.team",
                                  "--budgets", str(out / "budgets.toml"), "--basis", "allocation",
                                  "--html", str(path)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"html: {path}" in proc.stderr
    return path


class _Page(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def test_the_page_is_self_contained_with_every_chart_and_table(page, out):
    text = page.read_text(encoding="utf-8")
    parser = _Page()
    parser.feed(text)
    tags = [t for t, _ in parser.tags]
    # Nothing is loaded from elsewhere: no script, no linked style sheet, image or frame.
    assert not {"script", "link", "img", "iframe", "object", "embed"} & set(tags)
    assert not any(a.get("src") or a.get("href") for _, a in parser.tags)
    assert "url(" not in text and "@import" not in text
    figures = [a["id"] for t, a in parser.tags if t == "figure"]
    assert figures == list(CHARTS)
    svgs = re.findall(r"<svg.*?</svg>", text, re.S)
    assert len(svgs) == len(CHARTS)
    marks = {}
    for chart, svg in zip(CHARTS, svgs):
        root = ET.fromstring(svg)  # each chart is well-formed SVG
        marks[chart] = [r for r in root.iter(f"{SVG}rect")
                        if float(r.get("width", 0)) > 0 and float(r.get("height", 0)) > 0]
    report = cost_report(out / "out", by="metadata.team", basis="allocation")
    # One bar per group (one hour here), per group, per cost bin, per kind with time, per budget.
    assert len(marks["cost-over-time"]) >= len(report.groups) == 4
    assert len(marks["usd-per-million-tokens"]) == 4
    assert sum(1 for r in marks["cost-per-request"]) == len([b for b in report.cost_distribution if b.requests])
    assert sum(b.requests for b in report.cost_distribution) == 20
    assert len(marks["budgets"]) >= 3
    # Tables: every group, escaped; the summary lines; the budget statuses.
    assert "&lt;b&gt;&amp;co&lt;/b&gt;" in text and "<b>&co</b>" not in text
    assert "TOTAL (every row)" in text and "metadata.team=ads" in text and "OVER BUDGET" in text
    assert f"{report.totals.billed.cost_usd:.6f}" in text


def test_rendering_an_empty_report_draws_empty_charts(tmp_path):
    (tmp_path / "costs").mkdir()
    text = render_html(cost_report(tmp_path))
    assert text.count("<svg") == len(CHARTS) and "(no billed requests)" in text and "no budgets" in text


_PROBE = """<script>
addEventListener('load', () => {
  const found = [...document.querySelectorAll('figure')].map(f => {
    const svg = f.querySelector('svg'); const box = svg.getBoundingClientRect();
    const marks = [...svg.querySelectorAll('rect')].filter(r => r.getBBox().width > 0 && r.getBBox().height > 0);
    return f.id + ':' + Math.round(box.width) + 'x' + Math.round(box.height) + ':' + marks.length;
  });
  const out = document.createElement('pre'); out.id = 'probe'; out.textContent = found.join(' ');
  document.body.appendChild(out);
});
</script>"""


@pytest.mark.skipif(chromium() is None, reason="no Chromium installed (chromium on PATH, or CHROME_BIN)")
def test_headless_chromium_lays_out_every_chart(page, tmp_path):
    # A copy with a probe that measures each chart as the browser laid it out (the page itself has
    # no script).
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", _PROBE + "</body>"), encoding="utf-8")
    proc = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                           "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = re.search(r'<pre id="probe">([^<]*)</pre>', proc.stdout)
    assert found, proc.stdout[-2000:]
    charts = {}
    for item in found.group(1).split():
        chart, size, marks = item.split(":")
        width, height = map(int, size.split("x"))
        charts[chart] = (width, height, int(marks))
    assert list(charts) == list(CHARTS)
    for chart, (width, height, marks) in charts.items():
        assert width >= 700 and height >= 60 and marks >= 1, (chart, charts[chart])
    shot = tmp_path / "shot.png"
    subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1100,3000", page.as_uri()], capture_output=True, timeout=120)
    assert shot.stat().st_size > 10_000
