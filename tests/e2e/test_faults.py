"""Fault injection against a real megatraind (issue: reliability under faults).

Each test provokes one fault and checks what a lab user cares about: nothing submitted is
lost, the previous checkpoint stays whole and loadable, the job that hit the fault says
why, and the daemon and the other jobs go on.

  - a full disk while a checkpoint is written (an LD_PRELOAD shim makes writes into the
    checkpoint's temporary folder fail with ENOSPC while an "arm" file exists);
  - the model's safetensors truncated, or removed between submission and start;
  - the dataset truncated while a job trains on it;
  - an error inside a job (a broken line past the lines checked at submission);
  - kill -9 of the daemon at random moments, 50 times, with jobs queued and running.

Run by ctest (e2e.faults), or by hand: MEGATRAIN_BIN_DIR=build MEGATRAIN_FAULT_SHIM=
build/tests/fault/libmt_fault_enospc.so python3 -m unittest -v test_faults (in tests/e2e).
"""

import glob
import json
import os
import random
import sqlite3
import subprocess
import time
import unittest

from test_daemon_cli import (EXIT_OK, WAIT_S, DaemonTestCase, make_spec, read_safetensors_header,
                             step_of, to_yaml, write_dataset)

SHIM = os.environ.get("MEGATRAIN_FAULT_SHIM", "")


def checkpoints_in(folder):
    """Complete checkpoints (checkpoint-N) in a folder, by step."""
    found = {}
    for path in glob.glob(os.path.join(folder, "checkpoint-*")):
        found[int(path.rsplit("-", 1)[1])] = path
    return dict(sorted(found.items()))


class DiskFullTest(DaemonTestCase):
    def daemon_env(self):
        if not SHIM:
            self.skipTest("MEGATRAIN_FAULT_SHIM is not set (ctest sets it)")
        self.arm = os.path.join(self.tmp, "disk-full")
        return {"LD_PRELOAD": SHIM, "MEGATRAIN_FAULT_PATH": "/.checkpoint-",
                "MEGATRAIN_FAULT_ARM": self.arm}

    def test_disk_full_during_a_checkpoint_keeps_the_last_one_and_training_goes_on(self):
        ckpt = os.path.join(self.tmp, "ckpts")
        spec = make_spec(steps=400, checkpoint={"dir": ckpt, "every_steps": 10, "keep_last": 5})
        job_id = self.submit(spec)
        self.wait_for(job_id, lambda j: 10 in checkpoints_in(ckpt), "checkpointed at step 10")
        open(self.arm, "w").close()  # the disk is full from now on
        self.wait_for(job_id, lambda j: any("No space left on device" in t
                                            for t in self.log_texts(job_id)),
                      "reporting the full disk")
        job = self.status(job_id)
        self.assertEqual(job["state"], "JOB_STATE_RUNNING", "a failed checkpoint is not fatal")
        texts = self.log_texts(job_id)
        failed = [t for t in texts if "No space left on device" in t]
        self.assertIn("training goes on", failed[0])
        self.assertRegex(failed[0], r"the last checkpoint is step \d+")
        # What was written before the fault is whole and loads; no half checkpoint remains.
        good = checkpoints_in(ckpt)
        self.assertTrue(good)
        for step, path in good.items():
            header, _ = read_safetensors_header(os.path.join(path, "model.safetensors"))
            self.assertIn("model.embed_tokens.weight", header)
            with open(os.path.join(path, "trainer_state.json")) as f:
                self.assertEqual(json.load(f)["step"], step)
        self.assertEqual(glob.glob(os.path.join(ckpt, ".checkpoint-*.tmp")), [])
        # Space again: the next interval writes a checkpoint and the job finishes.
        last_good = max(good)
        os.remove(self.arm)
        self.wait_for(job_id, lambda j: max(checkpoints_in(ckpt), default=0) > last_good + 10,
                      "checkpointing again")
        self.cli_ok("cancel", job_id)


class ModelFilesTest(DaemonTestCase):
    def make_model(self):
        """A Hugging Face folder: the checkpoint of a one-step local run."""
        ckpt = os.path.join(self.tmp, "made")
        self.run_local(make_spec(steps=1, checkpoint={"dir": ckpt}), "make.yaml")
        (path,) = checkpoints_in(ckpt).values()
        return path

    def model_spec(self, model):
        spec = make_spec(steps=2)
        spec["model"] = {"path": model}
        return spec

    def test_truncated_model_file_fails_the_job_naming_the_file(self):
        model = self.make_model()
        shard = os.path.join(model, "model.safetensors")
        size = os.path.getsize(shard)
        with open(shard, "r+b") as f:
            f.truncate(size // 2)
        r = self.cli("submit", self.spec_file(self.model_spec(model)))
        if r.returncode == EXIT_OK:  # refused at run time instead of at submission
            job_id = int(json.loads(self.cli("-o", "json", "list").stdout)["jobs"][0]["id"])
            job = self.wait_state(job_id, "failed")
            message = job["error"]
        else:
            message = r.stderr
        self.assertIn("model.safetensors", message)
        # The daemon goes on.
        self.watch_ok(self.submit(make_spec(steps=2), name="next.yaml"))

    def test_model_file_removed_before_the_job_starts_fails_it_naming_the_file(self):
        model = self.make_model()
        job_id = self.submit(self.model_spec(model), "--hold")
        os.remove(os.path.join(model, "model.safetensors"))
        self.cli_ok("release", job_id)
        job = self.wait_state(job_id, "failed")
        self.assertIn("safetensors", job["error"])
        self.assertIn(model, job["error"])
        self.watch_ok(self.submit(make_spec(steps=2), name="next.yaml"))


class DataFaultTest(DaemonTestCase):
    def test_dataset_truncated_mid_run(self):
        data = os.path.join(self.tmp, "live.jsonl")
        write_dataset(data, docs=400, seed=3)
        spec = make_spec(steps=150, data="live.jsonl")
        job_id = self.submit(spec)
        self.wait_running_at(job_id, 5)
        # Cut the file in the middle of a line while the job trains on it.
        size = os.path.getsize(data)
        with open(data, "r+b") as f:
            f.truncate(size // 2 + 7)
        # The running job trains from the tokens it read at start: it finishes.
        self.watch_ok(job_id)
        self.assertEqual(step_of(self.status(job_id)), 150)
        # A new job on the cut file is told which line is broken.
        r = self.cli("submit", self.spec_file(make_spec(steps=2, data="live.jsonl"),
                                              "again.yaml"))
        if r.returncode == EXIT_OK:
            job = self.wait_state(int(json.loads(
                self.cli("-o", "json", "list").stdout)["jobs"][0]["id"]), "failed")
            message = job["error"]
        else:
            message = r.stderr
        self.assertIn("live.jsonl:", message)

    def test_error_inside_a_job_fails_it_and_the_queue_goes_on(self):
        data = os.path.join(self.tmp, "late-break.jsonl")
        write_dataset(data, docs=300, seed=4)
        with open(data, "a") as f:
            f.write('{"text": "a line that ends too early\n')  # line 301: past the checked 64
        bad = self.submit(make_spec(steps=5, data="late-break.jsonl"), name="bad.yaml")
        good = self.submit(make_spec(steps=5), name="good.yaml")
        job = self.wait_state(bad, "failed")
        self.assertIn("late-break.jsonl:301", job["error"])
        self.watch_ok(good)
        self.assertEqual(self.status(good)["state"], "JOB_STATE_SUCCEEDED")


class Kill9Test(DaemonTestCase):
    def test_kill9_at_random_moments_fifty_times_loses_nothing(self):
        rng = random.Random(1234)
        jobs = {}
        for i in range(4):
            spec = make_spec(steps=40 + 10 * i, name=f"job{i}", data_seed=i,
                             checkpoint={"every_steps": 5})
            jobs[self.submit(spec, name=f"job{i}.yaml")] = 40 + 10 * i
        kills = 0
        for trial in range(50):
            if trial % 10 == 5:  # keep submitting while the daemon keeps dying
                spec = make_spec(steps=20, name=f"late{trial}", checkpoint={"every_steps": 5})
                jobs[self.submit(spec, name=f"late{trial}.yaml")] = 20
            time.sleep(rng.uniform(0.0, 1.5))
            self.daemon.kill9()
            kills += 1
            self.daemon.start()
        self.assertEqual(kills, 50)
        # Nothing lost: every job is there, and every one finishes.
        listed = {int(j["id"]) for j in self.cli_json("list")["jobs"]}
        self.assertEqual(listed, set(jobs))
        resumed = 0
        for job_id, steps in jobs.items():
            self.watch_ok(job_id)
            job = self.status(job_id)
            self.assertEqual(job["state"], "JOB_STATE_SUCCEEDED")
            self.assertEqual(step_of(job), steps)
            resumed += int(job.get("resumed_from_step", 0)) > 0
        self.assertGreater(resumed, 0, "no kill landed while a job ran: the test proved nothing")
        # The store is whole.
        db = glob.glob(os.path.join(self.daemon.state_dir, "*.db")) + \
            glob.glob(os.path.join(self.daemon.state_dir, "*.sqlite*"))
        self.assertTrue(db, os.listdir(self.daemon.state_dir))
        self.daemon.stop()
        with sqlite3.connect(db[0]) as conn:
            self.assertEqual(conn.execute("PRAGMA integrity_check").fetchone()[0], "ok")
        self.daemon.start()


if __name__ == "__main__":
    unittest.main()
