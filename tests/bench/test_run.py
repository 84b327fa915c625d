"""bench/run.sh, the benchmark runner, with stand-ins for the benchmark programs: --list names
every suite it runs, and a suite's runs land in RESULTS/<hardware>/<suite>.json, replaced when
the suite runs again."""

import glob
import json
import os
import re
import subprocess
import tempfile
import unittest

_HERE = os.path.dirname(os.path.abspath(__file__))
RUN = os.path.join(_HERE, "..", "..", "bench", "run.sh")


def stub(folder, name, stdout, rc=0):
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\necho '{stdout}'\necho a log line >&2\nexit {rc}\n")
    os.chmod(path, 0o755)


class RunTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.bin = os.path.join(self.tmp.name, "bin")
        os.mkdir(self.bin)
        self.results = os.path.join(self.tmp.name, "results")
        self.env = dict(os.environ, PATH=self.bin + os.pathsep + os.environ["PATH"],
                        RESULTS=self.results, WORK=os.path.join(self.tmp.name, "work"),
                        TOKENIZER="tokenizer.json", INPUT="input.txt")

    def tearDown(self):
        self.tmp.cleanup()

    def run_suites(self, *suites):
        return subprocess.run(["bash", RUN, *suites], env=self.env, cwd=self.tmp.name,
                              capture_output=True, text=True, timeout=60)

    def test_list_names_every_suite_the_runner_runs(self):
        p = self.run_suites("--list")
        self.assertEqual(p.returncode, 0, p.stderr)
        listed = {line.split()[0] for line in p.stdout.splitlines()}
        with open(RUN) as f:
            text = f.read()
        cases = set()
        for label in re.findall(r"^    ([a-z0-9|-]+)\)", text, re.M):
            cases.update(label.split("|"))
        self.assertEqual(listed, cases)

    def test_a_suite_writes_its_result_and_replaces_it(self):
        stub(self.bin, "tokenizer_bench", '{"bytes_per_second": 1}')
        p = self.run_suites("tokenizer")
        self.assertEqual(p.returncode, 0, p.stderr)
        (path,) = glob.glob(os.path.join(self.results, "*", "tokenizer.json"))
        with open(path) as f:
            result = json.load(f)
        self.assertEqual(result["suite"], "tokenizer")
        run = result["runs"]["tokenizer"]
        self.assertEqual((run["rc"], run["result"]), (0, {"bytes_per_second": 1}))
        self.assertIn("--tokenizer tokenizer.json", run["command"])
        self.assertEqual(run["log_tail"], ["a log line"])

        stub(self.bin, "tokenizer_bench", '{"bytes_per_second": 2}', rc=3)
        self.run_suites("tokenizer")
        with open(path) as f:
            run = json.load(f)["runs"]["tokenizer"]
        self.assertEqual((run["rc"], run["result"]), (3, {"bytes_per_second": 2}))

    def test_an_unknown_suite_fails(self):
        p = self.run_suites("no-such-suite")
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("unknown suite", p.stderr)


if __name__ == "__main__":
    unittest.main()
