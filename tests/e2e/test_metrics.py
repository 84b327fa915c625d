"""Metrics end to end: a real megatraind running a real job, scraped by Debian's real
Prometheus server.

  - the exposition passes `promtool check metrics`;
  - every PromQL expression of every panel in dashboards/*.json returns data from
    Prometheus (the dashboard variables $job, $gpu, $user match everything);
  - a job's series leave /metrics when it stops (bounded cardinality);
  - deploy/prometheus/prometheus.yml passes `promtool check config`.

Skips only when `prometheus` or `promtool` is missing (deploy/install-deps.sh installs
Debian's prometheus package). Standard library only.
"""

import glob
import json
import os
import re
import shutil
import socket
import subprocess
import time
import unittest
import urllib.parse
import urllib.request

import test_daemon_cli as e2e

_HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(_HERE, "..", ".."))
DASHBOARDS = sorted(glob.glob(os.path.join(ROOT, "dashboards", "*.json")))
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
DPO_PANELS = "Preference (DPO): "  # dashboards/generate.py's DPO_PANEL_PREFIX


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8")


def dashboard_exprs():
    """(dashboard file, panel title, expr) of every target, variables substituted."""
    out = []
    for path in DASHBOARDS:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        for p in d["panels"]:
            for t in p.get("targets", []):
                expr = t["expr"]
                for var in ("job", "gpu", "user"):
                    expr = expr.replace(f"${var}", ".*")
                expr = expr.replace("$__rate_interval", "15s").replace("$__range", "5m")
                out.append((os.path.basename(path), p["title"], expr))
    return out


def metrics_port(daemon):
    m = re.search(r"metrics http://[^:]+:(\d+)/metrics", daemon.log())
    if not m:
        raise AssertionError(f"megatraind did not say where its metrics are:\n{daemon.log()}")
    return int(m.group(1))


@unittest.skipUnless(PROMETHEUS and PROMTOOL, "Debian's prometheus package is not installed")
class MetricsTest(e2e.DaemonTestCase):

    def start_prometheus(self, target_port):
        """Prometheus on a free port. The port is picked here and released, so another
        test's process can take it first: Prometheus then exits, and we try another."""
        config = os.path.join(self.tmp, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                    "scrape_configs:\n  - job_name: megatraind\n    static_configs:\n"
                    f"      - targets: ['127.0.0.1:{target_port}']\n")
        for _ in range(3):
            port = free_port()
            log = open(os.path.join(self.tmp, "prometheus.log"), "ab")
            proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}",
                 f"--storage.tsdb.path={os.path.join(self.tmp, 'tsdb')}",
                 f"--web.listen-address=127.0.0.1:{port}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            self.addCleanup(lambda p=proc, l=log: (p.terminate(), p.wait(30), l.close()))
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + e2e.WAIT_S
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if "Ready" in http_get(base + "/-/ready", timeout=2):
                        return base
                except OSError:
                    pass
                time.sleep(0.2)
            if proc.poll() is None:
                break  # running but never ready: not a port clash
        self.fail("prometheus did not become ready")

    def query(self, base, expr):
        url = base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        return json.loads(http_get(url))

    def test_dashboards_return_data_and_exposition_is_valid(self):
        self.assertTrue(DASHBOARDS, "no dashboards found")
        port = metrics_port(self.daemon)
        # A job that runs until cancelled and checkpoints every few steps; a mixture of
        # experts, so that the load-balancing loss has data too.
        spec = e2e.make_spec(steps=100000, name="metrics",
                             checkpoint={"dir": "ckpt", "every_steps": 3, "keep_last": 1})
        spec["model"]["config"] = e2e.MOE_CONFIG
        spec["eval"] = {"path": spec["data"]["path"], "every_steps": 2, "max_rows": 4}
        e2e.write_spec(os.path.join(self.tmp, "job.yaml"), spec)
        job = self.cli_json("submit", "job.yaml")["id"]
        base = self.start_prometheus(port)

        # Wait until the job has checkpointed and Prometheus holds a few scrapes of it.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            r = self.query(base, f'megatrain_checkpoint_duration_seconds_count{{job="{job}"}}')
            if r["data"]["result"] and float(r["data"]["result"][0]["value"][1]) >= 2:
                break
            time.sleep(0.5)
        time.sleep(4)  # rate() over 15s needs two samples after the first step

        text = http_get(f"http://127.0.0.1:{port}/metrics")
        check = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                               text=True)
        self.assertEqual(check.returncode, 0, f"promtool check metrics:\n{check.stdout}"
                                              f"{check.stderr}\n{text}")

        exprs = [e for e in dashboard_exprs() if not e[1].startswith(DPO_PANELS)]
        self.assert_data(base, exprs)

        # The job's series go when it stops; the box's stay.
        self.cli_ok("cancel", job)
        deadline = time.monotonic() + e2e.WAIT_S
        while time.monotonic() < deadline:
            text = http_get(f"http://127.0.0.1:{port}/metrics")
            if f'job="{job}"' not in text:
                break
            time.sleep(0.2)
        self.assertNotIn(f'job="{job}"', text)
        self.assertIn('megatrain_jobs{state="cancelled"} 1', text)

        # A DPO job for the panels of its metrics.
        e2e.write_pairs(os.path.join(self.tmp, "pairs.jsonl"))
        dpo = e2e.make_spec(steps=100000, name="dpo", data="pairs.jsonl",
                            checkpoint={"dir": "dpo-ckpt"})
        dpo["dpo"] = {"beta": 0.1}
        dpo["eval"] = {"path": "pairs.jsonl"}  # evaluated before the first step
        e2e.write_spec(os.path.join(self.tmp, "dpo.yaml"), dpo)
        dpo_job = self.cli_json("submit", "dpo.yaml")["id"]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            r = self.query(base, f'megatrain_dpo_rewards_margins{{job="{dpo_job}"}}')
            if r["data"]["result"]:
                break
            time.sleep(0.5)
        self.assert_data(base, [e for e in dashboard_exprs() if e[1].startswith(DPO_PANELS)])
        self.cli_ok("cancel", dpo_job)

    def assert_data(self, base, exprs):
        """Every (board, title, expr) of exprs answers with data."""
        empty = []
        for board, title, expr in exprs:
            r = self.query(base, expr)
            self.assertEqual(r["status"], "success", f"{board} / {title}: {expr}: {r}")
            if not r["data"]["result"]:
                empty.append(f"{board} / {title}: {expr}")
        self.assertEqual(empty, [], "dashboard expressions without data:\n" + "\n".join(empty))
        print(f"\n{len(exprs)} dashboard expressions, all with data")

    def test_deploy_scrape_config_is_valid(self):
        r = subprocess.run([PROMTOOL, "check", "config",
                            os.path.join(ROOT, "deploy", "prometheus", "prometheus.yml")],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)


if __name__ == "__main__":
    unittest.main()
