"""The Grafana dashboard against a real Prometheus (Debian's package): a short training serves its
metrics, Prometheus scrapes them every second, and every panel expression of the dashboard, with
its variables resolved the way Grafana resolves them, must return at least one series.

Also static checks of the dashboard JSON (classic model, schemaVersion >= 41, datasource by uid,
up to date with grafana/build_dashboard.py) and of the provisioning files.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml

import numwatch
from numwatch.demo import GPTConfig, TinyGPT, bigram_batches

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "numwatch.json"
PROMETHEUS = shutil.which("prometheus")
JOB = "numwatch-e2e"


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def expressions(dashboard: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(panel title, target) of every query target of every panel."""
    return [
        (panel["title"], target)
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


# ------------------------------------------------------------------------------ static checks
def test_dashboard_json_is_generated_from_builder():
    spec = importlib.util.spec_from_file_location("build_dashboard", GRAFANA / "build_dashboard.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    assert DASHBOARD.read_text() == builder.render(), "run: python grafana/build_dashboard.py"


def test_dashboard_model():
    board = load_dashboard()
    assert board["schemaVersion"] >= 41 and board["uid"] and "panels" in board
    names = [v["name"] for v in board["templating"]["list"]]
    assert names == ["datasource", "job", "rank", "layer"]
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24
        area = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & area, f"panel {panel['title']!r} overlaps another"
        cells |= area
        if panel["type"] != "row":
            assert panel["datasource"] == datasource
            assert panel["targets"] and all(t["datasource"] == datasource for t in panel["targets"])
    for _, target in expressions(board):
        assert "numwatch_" in target["expr"]
        assert '$job"' in target["expr"] and '$rank"' in target["expr"]


def test_provisioning_files():
    datasources = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "numwatch.yaml").read_text()
    )
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["uid"] == "numwatch-prometheus"
    current = load_dashboard()["templating"]["list"][0]["current"]["value"]
    assert current == source["uid"]
    providers = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "numwatch.yaml").read_text()
    )
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


# ------------------------------------------------------------------------------ Prometheus
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str, params: dict[str, str] | None = None) -> Any:
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]


def _wait_for(what: str, check: Callable[[], bool], timeout: float, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {proc.returncode} waiting for {what}")
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@contextmanager
def prometheus(tmp_path: Path, target: str) -> Iterator[str]:
    """A Prometheus on 127.0.0.1 scraping ``target`` every second; stopped on exit."""
    port = _free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": [target]}]}],
            }
        )
    )
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            with urllib.request.urlopen(url + "/-/ready", timeout=2) as r:
                return r.status == 200

        _wait_for("Prometheus to be ready", ready, 30, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _train(monitor, model, opt, scaler, cfg: GPTConfig, steps: int) -> None:
    data = bigram_batches(cfg, 4)
    for step in range(steps):
        x, y = next(data)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        if step == 3:  # a planted NaN: a scaler_overflow event, nonfinite counts, a scale drop
            model.blocks[1].mlp[2].weight.grad[0, 0] = float("nan")
        # a routed layer: attn_kernel_stabilized and attn_kernel_mode series (0: its fp32 calls
        # fall back) and attn_kernel_fallbacks_total{reason="dtype"}
        if step == 5:
            monitor.swap_attention("blocks.0.attn")
        monitor.step(loss)  # with a GradScaler the monitor closes steps itself
        scaler.step(opt)  # skips the update with the NaN
        scaler.update()
        opt.zero_grad()


def _promql_regex(value: str) -> str:
    """A variable value as Grafana puts it into a =~ matcher: regex-escaped, in a PromQL string."""
    return re.sub(r"([\\.^$*+?()\[\]{}|])", r"\\\\\1", value)


def _resolve(expr: str, chosen: dict[str, str]) -> str:
    for name, value in chosen.items():
        expr = expr.replace(f"${name}", value)
    assert "$" not in expr, f"unresolved variable in {expr!r}"
    return expr


def _label_values(api: str, definition: str, chosen: dict[str, str]) -> list[str]:
    """Grafana's label_values(selector, label) variable query, through the series API."""
    match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", definition)
    assert match, definition
    selector, label = match.groups()
    series = _get_json(api + "/api/v1/series", {"match[]": _resolve(selector, chosen)})
    return sorted({s[label] for s in series if label in s})


@pytest.mark.skipif(
    PROMETHEUS is None,
    reason="Debian's prometheus package is not installed (make test installs it with apt-get "
    "when it runs as root on Debian/Ubuntu)",
)
def test_every_panel_returns_series_from_real_prometheus(tmp_path):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=16, seq_len=16, d_model=32, n_heads=4, n_layers=2)
    model = TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    monitor = numwatch.Monitor(
        model,
        run_name="e2e",
        flush_every=2,
        attention__every=1,
        activations__every=1,
        optimizer__every=1,
        sinks__jsonl__enabled=False,
        sinks__console__enabled=False,
        sinks__prometheus__enabled=True,
        sinks__prometheus__port=0,
    ).attach(opt, scaler=scaler)
    try:
        target = monitor.prometheus_url.removeprefix("http://").removesuffix("/metrics")
        with prometheus(tmp_path, target) as api:
            steps = 10
            _train(monitor, model, opt, scaler, cfg, steps)

            def scraped_last_flush() -> bool:
                result = _get_json(
                    api + "/api/v1/query", {"query": f'numwatch_step{{job="{JOB}"}}'}
                )
                return bool(result["result"]) and result["result"][0]["value"][1] == str(steps - 1)

            _wait_for("a scrape of the last flush", scraped_last_flush, 30)
            (health,) = _get_json(api + "/api/v1/targets")["activeTargets"]
            assert health["health"] == "up", health

            board = load_dashboard()
            variables = [v for v in board["templating"]["list"] if v["type"] == "query"]
            # "All" as Grafana sends it (allValue .*), then one value of each, escaped.
            all_values: dict[str, str] = {}
            single: dict[str, str] = {}
            for var in variables:
                options = _label_values(api, var["definition"], single)
                assert options, f"variable ${var['name']} has no values"
                all_values[var["name"]] = var["allValue"]
                single[var["name"]] = _promql_regex(options[0])
            assert single["job"] == _promql_regex(JOB) and single["rank"] == "0"
            assert single["layer"] == _promql_regex("blocks.0.attn")

            now = time.time()
            empty = []
            for chosen in (all_values, single):
                for title, target in expressions(board):
                    expr = _resolve(target["expr"], chosen)
                    if target.get("instant"):
                        params = {"query": expr, "time": f"{now:.3f}"}
                        data = _get_json(api + "/api/v1/query", params)
                    else:
                        params = {"query": expr, "start": f"{now - 120:.3f}"}
                        params |= {"end": f"{now:.3f}", "step": "1"}
                        data = _get_json(api + "/api/v1/query_range", params)
                    if not data["result"]:
                        empty.append(f"{title!r}: {expr}")
            assert not empty, "panel expressions without series:\n" + "\n".join(empty)
    finally:
        monitor.detach()
