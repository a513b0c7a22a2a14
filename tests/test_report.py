"""report.html (`fedfields.report`): a run's self-contained page, written at the end of a run,
and checked in a real headless browser: every image decodes, the sections and settings show as
text, a hostile string shows as text. The browser is Debian's chromium: .ci/run installs it and
sets FEDFIELDS_REQUIRE_CHROMIUM=1, so CI never skips; elsewhere the browser tests skip without
it."""

from __future__ import annotations

import base64
import html
import io
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from PIL import Image
from test_meta_job import run_in_process, tiny

from fedfields.report import REPORT_FILE, write_report

BROWSER_SECONDS = 60
DATA_PNG = re.compile(r"data:image/png;base64,([A-Za-z0-9+/=]*)")
REQUIRE_BROWSER = "FEDFIELDS_REQUIRE_CHROMIUM"  # set by .ci/run: no chromium fails, not skips
# Runs before the page's Content-Security-Policy (which forbids scripts) takes effect, so the
# page is checked as written: on load it records every <img> that failed to decode, the
# headings and the text a person sees (innerText: rendered text only, no markup).
PAGE_PROBE = """<script>
window.addEventListener('load', () => {
  const images = Array.from(document.images);
  const broken = images.filter((i) => !(i.complete && i.naturalWidth > 0)).map((i) => i.alt);
  const headings = Array.from(document.querySelectorAll('h1, h2')).map((h) => h.innerText);
  const seen = {total: images.length, broken: broken, headings: headings,
                text: document.body.innerText};
  const out = document.createElement('pre');
  out.id = 'page-check';
  out.textContent = JSON.stringify(seen);
  document.body.appendChild(out);
});
</script>"""


def png(color: str) -> bytes:
    """A small PNG of one colour."""
    buffer = io.BytesIO()
    Image.new("RGB", (6, 4), color).save(buffer, format="PNG")
    return buffer.getvalue()


def synthetic_run(run_dir: Path) -> dict[str, bytes]:
    """A finished run's files (a hostile string in its config); returns its PNGs by path."""
    run_dir.mkdir()
    config = {"strategy": "<script>alert('x')</script>", "num-server-rounds": 3, "seed": 0}
    (run_dir / "config.json").write_text(json.dumps(config))
    rounds = [{"round": r, "train-psnr": 10.0 + r, "num-failures": 0} for r in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    summary = {"final": {"clean-psnr": 13.5}, "rounds": rounds, "seconds": 4.2}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    audit = {"pipeline": "scene", "leakage": {"personal-psnr": 5.6}}
    (run_dir / "audit.json").write_text(json.dumps(audit))
    alphas = [{"round": 1, "user": u, "alpha": 0.5} for u in (0, 1)]
    (run_dir / "alphas.jsonl").write_text("".join(json.dumps(a) + "\n" for a in alphas))
    (run_dir / "renders").mkdir()
    pngs = {"leakage.png": png("red"), "renders/user_00.png": png("blue")}
    for name, data in pngs.items():
        (run_dir / name).write_bytes(data)
    return pngs


def test_the_report_shows_the_run_escaped_and_self_contained(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    pngs = synthetic_run(run_dir)
    path = write_report(run_dir)
    assert path == run_dir / REPORT_FILE and not list(run_dir.glob("*.partial"))
    page = path.read_text()
    for key in ("strategy", "num-server-rounds", "seed", "clean-psnr", "personal-psnr"):
        assert f"<th>{key}</th>" in page
    assert "<script" not in page and html.escape("<script>alert('x')</script>") in page
    embedded = [base64.b64decode(data) for data in DATA_PNG.findall(page)]
    assert len(embedded) == len(pngs) + 1  # and the quality curves drawn from metrics.jsonl
    assert set(pngs.values()) <= set(embedded)
    assert not re.search(r"""(?:src|href)=['"](?!data:)""", page)  # nothing to fetch
    assert "<th>user 1</th>" in page  # alphas.jsonl as a round x user grid
    # num-failures stays 0 over the rounds: one line, not a flat plot; train-psnr is drawn
    assert "constant over the run: num-failures 0</p>" in page
    assert str(tmp_path) not in page  # the run's name, never its absolute path
    (run_dir / "extra.png").write_bytes(png("green"))  # written again whole, e.g. by an audit
    assert write_report(run_dir).read_text().count("data:image/png") == len(pngs) + 2


def test_a_reader_sees_what_ran_the_final_figures_renders_then_grouped_curves(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "scene-run"
    synthetic_run(run_dir)
    config = {"task": "scene", "mode": "federated", "strategy": "decentnerf"}
    (run_dir / "config.json").write_text(json.dumps(config | {"num-server-rounds": 3, "seed": 1}))
    final = {"clean-psnr": 21.5, "personal-psnr": 9.0, "personal-psnr-floor": 8.5}
    rounds = [
        {"round": r, "clean-psnr": 15.0 + r, "personal-psnr": 8.0 + r / 10, "bytes-up": 100 * r}
        for r in (1, 2, 3)
    ]
    summary = {"secure-aggregation": {"enabled": True}, "final": final, "rounds": rounds}
    (run_dir / "summary.json").write_text(json.dumps(summary | {"seconds": 61.0}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    gif = Image.new("RGB", (4, 4), "red")
    gif.save(run_dir / "orbit.gif", save_all=True, append_images=[Image.new("RGB", (4, 4))])
    page = write_report(run_dir).read_text()
    assert "decentnerf on task scene (federated) · 3 of 3 rounds · seed 1 · secure " in page
    order = [page.index(f"<h2>{name}</h2>") for name in ("Final figures", "Renders", "Figures")]
    order += [page.index(f"<h3>{group}</h3>") for group in ("quality", "privacy", "cost")]
    assert order == sorted(order)
    assert "personal-psnr is +0.50 dB from its floor" in page  # within the margin: no leak
    assert "scene quality" in page  # clean-psnr's meaning
    assert page.count("data:image/gif;base64,") == 1 and "orbiting" in page
    assert "health" not in page  # no health metric in this run's lines
    final["personal-psnr"] = 12.0
    (run_dir / "summary.json").write_text(json.dumps(summary))
    assert "3.50 dB above its floor" in write_report(run_dir).read_text()


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cheapest real run: FedMeNF on faces, in process, without the simulation audit."""
    run_dir = tmp_path_factory.mktemp("report") / "faces"
    return run_in_process(tiny(run_dir, **{"simulation-audit": False}))[0]


def test_a_run_ends_with_its_report(real_run: Path) -> None:
    page = (real_run / REPORT_FILE).read_text()
    pngs = list(real_run.rglob("*.png"))
    curves = page.count("curves from metrics.jsonl")
    assert pngs and curves >= 2 and page.count("data:image/png") == len(pngs) + curves
    assert "<th>tto-steps</th>" in page and "tto.png" in page
    assert not list(real_run.glob("*.partial"))


@pytest.fixture
def chromium() -> str:
    """The headless browser's path; without one a skip (chromium is optional: apt install
    chromium), or a failure where `REQUIRE_BROWSER` is set (CI)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None and os.environ.get(REQUIRE_BROWSER) == "1":
        pytest.fail(f"no chromium on PATH although {REQUIRE_BROWSER}=1 (.ci/run installs it)")
    if path is None:
        pytest.skip("no chromium on PATH: the browser check of report.html is optional")
    return path


def page_in_browser(chromium: str, page: Path, work: Path) -> dict:
    """Open a copy of `page` (with `PAGE_PROBE`) in headless chromium; returns what the probe
    saw: {"total": images, "broken": [alt of each image that did not load], "headings": [h1
    and h2 texts], "text": the page's rendered text}."""
    text = page.read_text()
    assert "<head>" in text
    probe = work / "probed.html"
    probe.write_text(text.replace("<head>", "<head>\n" + PAGE_PROBE, 1))
    command = [chromium, "--headless=new", "--no-sandbox", "--disable-gpu"]
    command += [f"--user-data-dir={work / 'profile'}", "--dump-dom", probe.as_uri()]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        dom, errors = process.communicate(timeout=BROWSER_SECONDS)
    finally:  # the browser and its helper processes, on success, failure or timeout
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    found = re.search(r'<pre id="page-check">(.*?)</pre>', dom.decode(), re.DOTALL)
    assert found, f"the probe did not report; chromium said: {errors.decode()[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


def test_every_image_of_a_real_report_loads_in_a_browser(
    chromium: str, real_run: Path, tmp_path: Path
) -> None:
    page = real_run / REPORT_FILE
    result = page_in_browser(chromium, page, tmp_path)
    assert result["broken"] == []
    assert result["total"] == page.read_text().count("data:image/png") > 1
    title = f"fedfields run {real_run.name}"
    assert result["headings"] == [
        title,
        "Final figures",
        "Figures",
        "Curves",
        "Summary",
        "Run config",
    ]
    settings = json.loads((real_run / "config.json").read_text())
    shown = result["text"]
    assert "after test-time optimisation" in shown  # the final figure's meaning
    assert "2 of 2 rounds" in shown and "faces" in shown  # the line of what ran
    assert all(key in shown for key in settings), "a run-config key is not on the page"
    assert f"task\t{settings['task']}" in shown  # a table row: key and value side by side
    assert "tto.png" in shown


def test_a_hostile_string_shows_as_text_in_a_browser(chromium: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    synthetic_run(run_dir)
    result = page_in_browser(chromium, write_report(run_dir), tmp_path)
    assert "strategy\t<script>alert('x')</script>" in result["text"]
    assert result["broken"] == [] and result["total"] == 3
    assert "Federation weights (alphas.jsonl)" in result["headings"]


def test_the_browser_check_finds_a_broken_image(chromium: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    synthetic_run(run_dir)
    page = write_report(run_dir)
    text = page.read_text()
    image = DATA_PNG.search(text)
    assert image
    broken = text[: image.start(1)] + base64.b64encode(b"not a png").decode() + text[image.end(1) :]
    page.write_text(broken)
    result = page_in_browser(chromium, page, tmp_path)
    assert result["total"] == text.count("data:image/png") and len(result["broken"]) == 1


def fake_tool(directory: Path, name: str, script: str) -> None:
    """An executable `name` in `directory` running the bash `script`."""
    path = directory / name
    path.write_text(f"#!/bin/bash\n{script}\n")
    path.chmod(0o755)


def run_ci(tmp_path: Path, apt_get: str, chromium: bool) -> tuple[subprocess.CompletedProcess, str]:
    """.ci/run with PATH holding only fakes (apt-get, sudo, make) and the few tools it needs;
    returns the process and the log the fakes wrote."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "env", "id"):
        (bin_dir / tool).symlink_to(shutil.which(tool) or f"/usr/bin/{tool}")
    fake_tool(bin_dir, "sudo", '"$@"')
    fake_tool(bin_dir, "apt-get", f'echo "apt-get $* $DEBIAN_FRONTEND" >> {log}\n{apt_get}')
    fake_tool(bin_dir, "make", f'echo "make $* $FEDFIELDS_REQUIRE_CHROMIUM" >> {log}')
    if chromium:
        fake_tool(bin_dir, "chromium", "exit 0")
    environment = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    ci = Path(__file__).resolve().parents[1] / ".ci" / "run"
    process = subprocess.run([str(ci)], env=environment, capture_output=True, text=True, timeout=60)
    return process, log.read_text() if log.is_file() else ""


def test_ci_installs_chromium_when_missing_then_requires_the_browser_test(tmp_path: Path) -> None:
    installs = f'[ "$1" = install ] && printf "#!/bin/bash\\n" > {tmp_path}/bin/chromium'
    installs += f" && chmod +x {tmp_path}/bin/chromium; exit 0"
    process, log = run_ci(tmp_path, installs, chromium=False)
    assert process.returncode == 0, process.stderr
    assert log.splitlines() == [
        "apt-get update -q noninteractive",
        "apt-get install -y -q chromium noninteractive",
        "make test 1",
    ]


def test_ci_fails_loudly_when_chromium_cannot_be_installed(tmp_path: Path) -> None:
    process, log = run_ci(tmp_path, "exit 100", chromium=False)
    assert process.returncode == 1
    assert "ci: ERROR: could not install chromium" in process.stderr
    assert log.splitlines() == ["apt-get update -q noninteractive"]  # and make never ran


def test_ci_leaves_an_installed_chromium_alone(tmp_path: Path) -> None:
    process, log = run_ci(tmp_path, "exit 100", chromium=True)
    assert process.returncode == 0, process.stderr
    assert log.splitlines() == ["make test 1"]
