"""The dashboard in a real browser against a real PP=2 mesh with an API key.

Headless Chromium (Debian's ``chromium`` and ``chromium-driver``, which
``.ci/run`` installs) driven by Selenium loads ``GET /``, is asked for the
key, shows both stages with their layer ranges, shows a stage killed with
SIGKILL as unhealthy and then serving again (a new pid, the events listed),
and streams a chat answer from ``/v1/chat/completions`` (speculating with the
model's own weights as its draft: the replica shows the proposals accepted); ``stagemesh status
--watch`` draws the same figures in a terminal. Set
``STAGEMESH_DASHBOARD_SCREENSHOT=PATH`` to keep the screenshot it takes
(docs/images/dashboard.png is made that way).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import httpx
import pytest

from tests.e2e.serve_process import start_serve

pytestmark = pytest.mark.e2e

API_KEY = "dashboard-test-key"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    from stage_worker.checkpoint.convert import convert_gguf_to_mlx_dir
    from stage_worker.checkpoint.default_model import default_model_path

    # Speculation with the model's own weights as its draft: every answer's proposals show on the page.
    draft = convert_gguf_to_mlx_dir(str(default_model_path()), str(tmp_path_factory.mktemp("draft") / "model"))
    speculative = json.dumps({"model": draft, "num_speculative_tokens": 4})
    # Joined projections on (auto leaves them off on the CPU): the stages here serve the dashboard's requests
    # with the GPU's layer form (tests/test_fused_projections.py checks what it computes).
    serve = start_serve(tmp_path_factory.mktemp("dashboard"), "--api-key", API_KEY, "--speculative-config",
                        speculative, pp=2, env={"STAGEMESH_FUSE_PROJECTIONS": "on"})
    yield serve
    serve.stop()


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; "
                    ".ci/run installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1440,1100",
                "--disable-gpu"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def _rows(driver) -> dict[int, dict[str, str]]:
    """Replica 0's stage rows as the page shows them: rank -> layers, health, pid. Read in one script,
    because the page redraws every second (elements found one by one could go stale in between)."""
    rows = driver.execute_script("""
        return [...document.querySelectorAll('tr.stage[data-replica="0"]')].map((row) => ({
            rank: row.dataset.rank, healthy: row.dataset.healthy,
            layers: row.querySelector('td.layers').textContent, pid: row.querySelector('td.pid').textContent}));
    """)
    return {int(r["rank"]): r for r in rows}


def _texts(driver, selector: str, attribute: str | None = None) -> list[str]:
    """Text (or an attribute) of every element matching ``selector``, read in one script."""
    return driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map((e) => arguments[1] ? "
        "e.getAttribute(arguments[1]) : e.textContent);", selector, attribute)


def test_live_data_needs_the_key_like_v1(serve):
    assert httpx.get(f"{serve.url}/dashboard/live", timeout=10).status_code == 401
    assert httpx.get(f"{serve.url}/", timeout=10).status_code == 200  # the page holds no data
    live = httpx.get(f"{serve.url}/dashboard/live", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert live.status_code == 200
    assert [s["layers"] for s in live.json()["replicas"][0]["stages"]] == [[0, 15], [15, 30]]


def test_page_shows_stages_a_killed_stage_coming_back_and_streams_chat(serve, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 30, poll_frequency=0.2)
    browser.get(serve.url + "/")
    # With --api-key the page asks for the key before it shows anything.
    key_input = wait.until(lambda d: d.find_element(By.ID, "key-input") if d.find_element(
        By.ID, "key-form").is_displayed() else None)
    key_input.send_keys(API_KEY)
    browser.find_element(By.CSS_SELECTOR, "#key-form button").click()

    rows = wait.until(lambda d: (r := _rows(d)) and len(r) == 2 and all(v["healthy"] == "true" for v in r.values())
                      and r)
    assert (rows[0]["layers"], rows[1]["layers"]) == ("[0, 15)", "[15, 30)")
    segments = _texts(browser, '.replica[data-replica="0"] .depth .seg')
    assert segments == ["stage 0 · 0–15", "stage 1 · 15–30"]

    # Stage 1 dies (kill -9 by the pid the page shows): the page marks it unhealthy, then serving again.
    old_pid = int(rows[1]["pid"])
    assert old_pid == serve.mesh()["replicas"][0]["stages"][1]["pid"]
    os.kill(old_pid, signal.SIGKILL)
    WebDriverWait(browser, 30, poll_frequency=0.2).until(lambda d: _rows(d)[1]["healthy"] == "false")
    back = WebDriverWait(browser, 240, poll_frequency=0.5).until(
        lambda d: (r := _rows(d)) and all(v["healthy"] == "true" for v in r.values()) and r[1]["pid"] not in
        ("–", str(old_pid)) and r)
    assert int(back[1]["pid"]) != old_pid
    kinds = _texts(browser, "#events li", "data-kind")
    assert {"stage_lost", "replica_restarting", "replica_serving"} <= set(kinds)

    # The chat box streams an answer (with the key the page was given); greedy, so the answer is known.
    temperature = browser.find_element(By.ID, "chat-temperature")
    temperature.clear()
    temperature.send_keys("0")
    browser.find_element(By.ID, "chat-input").send_keys("What is the capital of France?")
    browser.find_element(By.ID, "chat-send").click()
    answer = WebDriverWait(browser, 120, poll_frequency=0.2).until(
        lambda d: (a := d.find_elements(By.CSS_SELECTOR, "#chat-log .assistant")) and a[-1].get_attribute(
            "data-done") and a[-1])
    assert answer.get_attribute("data-done") == "true", answer.text
    assert "Paris" in answer.text

    # The request shows in the live figures: a time to first token within the last minute, and once
    # it ended, nothing in flight and one request served.
    WebDriverWait(browser, 10, poll_frequency=0.2).until(lambda d: "p50" in _texts(d, '[data-card="ttft"] .sub')[0])
    WebDriverWait(browser, 10, poll_frequency=0.2).until(
        lambda d: _texts(d, '[data-card="running"] .value') == ["0"]
        and _texts(d, '[data-card="running"] .sub') == ["1 served since start"])
    # The answer's tokens were proposed by the draft and verified: the replica shows what it accepted.
    shown = WebDriverWait(browser, 10, poll_frequency=0.2).until(
        lambda d: (t := _texts(d, '.replica[data-replica="0"] .speculation')) and t[0])
    assert "% accepted" in shown and "tok/verification" in shown
    shot = os.environ.get("STAGEMESH_DASHBOARD_SCREENSHOT") or str(tmp_path / "dashboard.png")
    assert browser.save_screenshot(shot)


def test_status_watch_draws_the_same_figures_in_a_terminal(serve):
    command = [sys.executable, "-m", "stagemesh.cli", "status", "--watch", "--count", "2", "--interval", "0.5",
               "--url", serve.url]
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("STAGEMESH_API_KEY", None)
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode == 2 and "--api-key" in refused.stderr
    shown = subprocess.run([*command, "--api-key", API_KEY], capture_output=True, text=True, timeout=60, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "SmolLM2-135M-Instruct (30 layers)" in shown.stdout
    assert "[0, 15)" in shown.stdout and "[15, 30)" in shown.stdout
    assert "mesh_serving" in shown.stdout  # the events, with their times
