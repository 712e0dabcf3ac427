"""The dashboard in a real browser: Debian's headless Chromium driven by selenium (issue 39).

A 2-node local cluster runs a job that prints a line every half second and keeps node 0
busy; the page must show both node rows, a CPU figure that changes, the job's lines as
they come (before the job ends), its events, and its cancel and down buttons must work
(each after a confirmation). Screenshots are kept in ``test-artifacts/`` (``ARTIFACTS``).

Chromium and its driver come from Debian (``chromium``, ``chromium-driver``: installed
here when missing, as root; no browser is downloaded); selenium is a test dependency.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from _hosts import LabError, ensure_package
from _procs import alive, wait_until
from test_cli import CLI
from test_server import DEADLINE, Server, start_server

ARTIFACTS = Path(
    os.environ.get("FLOTILLA_TEST_ARTIFACTS") or Path(__file__).parent.parent / "test-artifacts"
)
CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
pytestmark = pytest.mark.timeout(600)  # its waits (DEADLINE each) decide, not the default 120 s


@pytest.fixture
def browser() -> Iterator[object]:
    if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            pytest.skip("needs Debian's chromium and chromium-driver (apt-get install, as root)")
        try:
            ensure_package("chromium", CHROMIUM)
            ensure_package("chromium-driver", DRIVER)
        except LabError as e:
            pytest.skip(str(e))
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.add_argument("--window-size=1400,1100")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=DRIVER))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    cli = CLI(tmp_path / "home", tmp_path)
    running = None
    try:
        running = start_server(cli)
        yield running
    finally:
        cli.clean_up()
        cli("server", "stop", timeout=60)
        if running is not None:
            assert wait_until(lambda: not alive(running.pid), timeout=60), "server left running"


JOB = """\
name: ticker
num_nodes: 2
run: |
  if [ "$FLOTILLA_NODE_RANK" = 0 ]; then
    python3 -c "import time; end = time.time() + 600
  while time.time() < end: pass" &
  fi
  for i in $(seq 1 600); do echo "tick $i on rank $FLOTILLA_NODE_RANK"; sleep 0.5; done
"""


def shot(driver: object, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))  # type: ignore[attr-defined]


def test_the_dashboard_shows_nodes_metrics_and_live_output(server: Server, browser: object) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    with server.client() as c:
        answer = c.post("/api/v1/clusters", params={"cluster": "dash", "nodes": "2"}, content=JOB)
        assert answer.status_code == 201, answer.text

    def find(css: str) -> list:  # type: ignore[type-arg]
        return driver.find_elements(By.CSS_SELECTOR, css)  # type: ignore[attr-defined]

    def text(css: str) -> str:  # read in the page at once: rows are redrawn meanwhile
        script = "const e = document.querySelector(arguments[0]); return e ? e.textContent : ''"
        return str(driver.execute_script(script, css))  # type: ignore[attr-defined]

    # the printed URL: the token becomes a cookie, the address loses it
    driver.get(f"{server.url}/?token={server.token}")  # type: ignore[attr-defined]
    assert wait_until(lambda: bool(find('#clusters tr[data-cluster="dash"]')), timeout=60)
    assert "token" not in driver.current_url  # type: ignore[attr-defined]
    cookie = driver.get_cookie("flotilla_token")  # type: ignore[attr-defined]
    assert cookie is not None and cookie["httpOnly"] is True
    assert driver.execute_script("return document.cookie") == ""  # type: ignore[attr-defined]
    shot(driver, "dashboard-overview")

    find('#clusters tr[data-cluster="dash"] a')[0].click()
    assert wait_until(lambda: len(find("#nodes tbody tr[data-node]")) == 2, timeout=DEADLINE)

    # a metric changes: node 0's CPU figure, as the views come
    assert wait_until(lambda: text('#nodes tr[data-node="0"] td.cpu').endswith("%"), DEADLINE)
    first = text('#nodes tr[data-node="0"] td.cpu')
    cell = find('#nodes tr[data-node="0"] td.cpu')[0]
    assert wait_until(lambda: text('#nodes tr[data-node="0"] td.cpu') != first, DEADLINE)
    # the redraw changed the element on the page instead of swapping it: a click that
    # lands while the rows are redrawn still reaches its link or button
    same = "return document.querySelector(arguments[0]) === arguments[1]"
    assert driver.execute_script(same, '#nodes tr[data-node="0"] td.cpu', cell)  # type: ignore[attr-defined]

    # output lines arrive live: more come while the job still runs
    assert wait_until(lambda: "tick 2 on rank 1" in text("#output"), timeout=DEADLINE)
    seen = text("#output").count("tick")
    assert wait_until(lambda: text("#output").count("tick") >= seen + 4, timeout=DEADLINE)
    with server.client() as c:
        assert c.get("/api/v1/clusters/dash/jobs/1").json()["status"] == "RUNNING"
    assert wait_until(lambda: "job 1 running" in text("#events"), timeout=DEADLINE)
    assert wait_until(
        lambda: len(find('#nodes tr[data-node="0"] td.cpu svg.spark polyline')) == 1, 60
    )
    shot(driver, "dashboard-cluster")

    # cancel, after a confirmation
    find('#jobs tr[data-job="1"] button.cancel')[0].click()
    alert = driver.switch_to.alert  # type: ignore[attr-defined]
    assert "cancel job 1 on dash?" in alert.text
    alert.accept()
    assert wait_until(lambda: "ended: CANCELLED" in text("#output"), timeout=DEADLINE)
    assert wait_until(lambda: "CANCELLED" in text('#jobs tr[data-job="1"]'), timeout=60)

    # down, after a confirmation: the cluster is gone
    find("#down")[0].click()
    alert = driver.switch_to.alert  # type: ignore[attr-defined]
    assert "tear down cluster dash?" in alert.text
    alert.accept()
    with server.client() as c:
        assert wait_until(
            lambda: c.get("/api/v1/clusters").json() == {"clusters": []}, timeout=DEADLINE
        )
    assert wait_until(lambda: not find('#clusters tr[data-cluster="dash"]'), timeout=60)


def test_a_128_node_cluster_is_one_paged_table(tmp_path: Path, browser: object) -> None:
    """128 nodes stay usable: one table of 50 rows a page, the pager saying how many, the
    next pages showing the next nodes, every node in the API and in /metrics. The cluster
    is a stand-in written as a daemon writes one (its record, and the pool's view in
    top.json, with a live process as its daemon): starting 128 nodes here would measure
    only this 2-core machine."""
    import subprocess

    from flotilla._system import procs
    from flotilla.cli.state import ClusterRecord, NodeRecord, Paths, delete, save, write_json
    from flotilla.events import NodeView, PoolView, view_dict

    cli = CLI(tmp_path / "home", tmp_path)
    daemon = subprocess.Popen(["sleep", "3600"])
    paths = Paths("big", cli.home)
    running = None
    try:
        nodes = [
            NodeRecord(
                node=i, ip=f"10.0.{i // 256}.{i % 256}", host=f"n{i}", workdir="/w", agent_pid=1
            )
            for i in range(128)
        ]
        rec = ClusterRecord(
            name="big",
            provider={"kind": "ssh"},
            num_nodes=128,
            state="UP",
            created=1.0,
            pid=daemon.pid,
            pid_start=procs.start_time(daemon.pid),
            nodes=nodes,
        )
        paths.ensure()
        save(paths, rec)
        view = PoolView(
            pool="big",
            phase="running",
            nodes=tuple(
                NodeView(
                    node=i,
                    phase="ready",
                    address=n.ip,
                    host=n.host,
                    metrics={
                        "cpu": float(i % 100),
                        "mem_used": 1e9,
                        "mem_total": 8e9,
                        "gpu_util_0": 50.0,
                        "gpu_util_1": float(i % 7),
                    },
                    sampled=2.0,
                    running=0,
                    done=i,
                    failed=0,
                )
                for i, n in enumerate(nodes)
            ),
            running=0,
            done=0,
            failed=0,
            functions={},
            time=2.0,
        )
        write_json(paths.dir / "top.json", view_dict(view))
        running = start_server(cli)
        with running.client() as c:
            assert len(c.get("/api/v1/clusters/big").json()["nodes"]) == 128
            assert c.get("/metrics").text.count('flotilla_node_cpu_percent{cluster="big"') == 128

        driver = browser

        def rows() -> list[str]:  # read in the page at once: the table is redrawn meanwhile
            script = (
                "return Array.from(document.querySelectorAll('#nodes tbody tr'))"
                ".map((r) => r.dataset.node)"
            )
            return [str(n) for n in driver.execute_script(script)]  # type: ignore[attr-defined]

        def pager() -> str:
            script = "const e = document.querySelector('#page'); return e ? e.textContent : ''"
            return str(driver.execute_script(script))  # type: ignore[attr-defined]

        driver.get(f"{running.url}/?token={running.token}")  # type: ignore[attr-defined]
        driver.get(f"{running.url}/#/cluster/big")  # type: ignore[attr-defined]
        assert wait_until(lambda: pager() == "page 1 of 3 (128 nodes)", timeout=60), pager()
        assert rows() == [str(i) for i in range(50)]
        gpu = "return document.querySelector('#nodes tr[data-node=\"3\"] td.gpu').textContent"
        assert driver.execute_script(gpu) == "50% 3%"  # type: ignore[attr-defined]
        for page, first, last in ((2, 50, 100), (3, 100, 128)):
            driver.execute_script(  # type: ignore[attr-defined]
                "Array.from(document.querySelectorAll('.pager button'))"
                ".find((b) => b.textContent === 'next').click()"
            )
            assert wait_until(lambda p=page: pager().startswith(f"page {p} of 3"), timeout=60)
            assert rows() == [str(i) for i in range(first, last)]
        shot(driver, "dashboard-128-nodes")
    finally:
        delete(paths)  # the stand-in's files: no `down` (its daemon is `sleep`)
        daemon.kill()
        daemon.wait()
        cli("server", "stop", timeout=60)
        if running is not None:
            assert wait_until(lambda: not alive(running.pid), timeout=60), "server left running"
