"""Sharing one megatraind among a lab group, with real local users (issue: sharing).

The module creates three real accounts (useradd) and an admin group (groupadd) for the
run, and removes them at the end: alice and bob are ordinary users, carol is in the
admin group. Each has a private home (mode 0700) under one temporary folder. The CLI runs
as each of them (setuid in the child), over the Unix socket, where megatraind learns who
calls from the kernel (SO_PEERCRED), and over TCP with TLS and per-user tokens.

What is checked:
  - identity: `whoami` over the socket and over TCP; no token, a bad one, a revoked one;
  - the permission matrix: anyone reads the queue; only the owner or an admin cancels,
    holds, releases or checkpoints; the audit log records each call with its outcome
    and only admins read it;
  - files: a spec cannot read another user's data or config, nor write checkpoints or a
    data cache into their folders, nor reach outside the configured roots or into the
    daemon's state; a link swapped in after submission is caught when the job starts;
    what a job writes belongs to its user;
  - scheduling: the priority ceiling, the queued-jobs limit, fair share (the user with
    less recent device time goes first), and preemption: a running job is checkpointed
    and requeued for higher priority work and then resumes, bit-exact with a run that
    was never interrupted.

Needs root (to create users and to run the daemon as a shared one); skipped otherwise.
Run by ctest (e2e.sharing), or by hand in tests/e2e:
MEGATRAIN_BIN_DIR=build python3 -m unittest -v test_sharing
"""

import grp
import json
import os
import pwd
import re
import shutil
import sqlite3
import subprocess
import tempfile
import time
import unittest

from test_daemon_cli import (CHECKPOINT_FILES, EXIT_OK, EXIT_RESOURCE_EXHAUSTED, KEEP, MEGATRAIN, WAIT_S,
                             DaemonTestCase, make_spec, resumed_step, step_of, to_yaml,
                             write_dataset)

EXIT_PERMISSION = 5  # PERMISSION_DENIED and UNAUTHENTICATED

SUFFIX = f"{os.getpid() % 100000}"
ALICE, BOB, CAROL = f"mta{SUFFIX}", f"mtb{SUFFIX}", f"mtc{SUFFIX}"
ADMINS = f"mtadm{SUFFIX}"
ROOT = None  # the module's folder: home/<user>/, outside/, tls/


def _run(*cmd):
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def setUpModule():
    global ROOT
    if os.geteuid() != 0:
        raise unittest.SkipTest("needs root: creates users and runs a shared megatraind")
    for tool in ("useradd", "userdel", "groupadd", "groupdel", "openssl"):
        if shutil.which(tool) is None:
            raise unittest.SkipTest(f"needs {tool}")
    ROOT = tempfile.mkdtemp(prefix="megatrain-share-")
    os.chmod(ROOT, 0o755)
    _run("groupadd", ADMINS)
    for user in (ALICE, BOB, CAROL):
        home = os.path.join(ROOT, "home", user)
        _run("useradd", "--no-create-home", "--home-dir", home, "--shell", "/bin/false",
             *(["--groups", ADMINS] if user == CAROL else []), user)
        os.makedirs(home)
        pw = pwd.getpwnam(user)
        os.chown(home, pw.pw_uid, pw.pw_gid)
        os.chmod(home, 0o700)
        write_dataset(os.path.join(home, "data.jsonl"), seed=len(user))
        chown(os.path.join(home, "data.jsonl"), user, 0o600)
    os.chmod(os.path.join(ROOT, "home"), 0o755)
    os.makedirs(os.path.join(ROOT, "outside"))
    write_dataset(os.path.join(ROOT, "outside", "data.jsonl"))
    os.chmod(os.path.join(ROOT, "outside", "data.jsonl"), 0o644)
    # A self-signed certificate for 127.0.0.1.
    tls = os.path.join(ROOT, "tls")
    os.makedirs(tls)
    _run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-keyout", os.path.join(tls, "key.pem"), "-out", os.path.join(tls, "cert.pem"),
         "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost")
    os.chmod(os.path.join(tls, "cert.pem"), 0o644)


def tearDownModule():
    for user in (ALICE, BOB, CAROL):
        subprocess.run(["userdel", user], capture_output=True)
    subprocess.run(["groupdel", ADMINS], capture_output=True)
    if ROOT and not KEEP:
        shutil.rmtree(ROOT, ignore_errors=True)


def home(user, *rel):
    return os.path.join(ROOT, "home", user, *rel)


def chown(path, user, mode):
    pw = pwd.getpwnam(user)
    os.chown(path, pw.pw_uid, pw.pw_gid)
    os.chmod(path, mode)


class SharingTestCase(DaemonTestCase):
    """A daemon with the sharing configuration: roots, admin group, limits, TCP+TLS."""

    LIMITS = {"max_queued_jobs": 3, "max_priority": 10}

    @property
    def port(self):
        """The TLS port the daemon bound. It is asked for port 0 and says which one it got:
        a port picked here and released could be taken by another test's daemon before
        this one binds it (CI saw that)."""
        m = re.findall(r"listening on \S+ and 127\.0\.0\.1:(\d+) \(TLS\)", self.daemon.log())
        if not m:
            raise AssertionError(f"megatraind did not say its TLS port:\n{self.daemon.log()}")
        return int(m[-1])

    def daemon_args(self):
        config = {
            "admin_group": ADMINS,
            # The users' homes, and root's dataset; not the daemon's state folder, which
            # holds the jobs' default checkpoint folders all the same.
            "file_roots": [os.path.join(ROOT, "home"), os.path.join(self.tmp, "data.jsonl")],
            "tcp_listen": "127.0.0.1:0",
            "tls_cert": os.path.join(ROOT, "tls", "cert.pem"),
            "tls_key": os.path.join(ROOT, "tls", "key.pem"),
            "limits": dict(self.LIMITS),
        }
        path = os.path.join(self.tmp, "megatraind.yaml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(to_yaml(config) + "\n")
        return ("--config", path)

    def as_user(self, user, *args, timeout=120, env=None):
        """`megatrain ARGS` run as `user` (uid, gid and groups of the account), from
        their home."""
        pw = pwd.getpwnam(user)
        groups = [g.gr_gid for g in grp.getgrall() if user in g.gr_mem]
        full_env = dict(os.environ, MEGATRAIN_ADDR=self.daemon.addr, HOME=pw.pw_dir)
        full_env.update(env or {})
        try:
            return subprocess.run([MEGATRAIN, *map(str, args)], capture_output=True, text=True,
                                  env=full_env, timeout=timeout, cwd=pw.pw_dir, user=pw.pw_uid,
                                  group=pw.pw_gid, extra_groups=groups)
        except subprocess.TimeoutExpired as e:
            self.fail(f"`megatrain {' '.join(map(str, args))}` as {user} did not end in "
                      f"{timeout} s ({e.stderr!r})")

    def expect(self, code, user, *args, **kwargs):
        r = self.as_user(user, *args, **kwargs)
        self.assertEqual(r.returncode, code,
                         f"`megatrain {' '.join(map(str, args))}` as {user}: exit "
                         f"{r.returncode}, wanted {code}\nstdout: {r.stdout}\nstderr: {r.stderr}")
        return r

    def json_as(self, user, *args, **kwargs):
        return json.loads(self.expect(EXIT_OK, user, "-o", "json", *args, **kwargs).stdout)

    def user_spec(self, user, spec, name="job.yaml"):
        """Writes `spec` into `user`'s home, owned by them; returns its path."""
        path = home(user, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(to_yaml(spec) + "\n")
        chown(path, user, 0o600)
        return path

    def submit_as(self, user, spec, *flags, name="job.yaml"):
        job = self.json_as(user, "submit", self.user_spec(user, spec, name), *flags)
        return int(job["id"])

    def refused(self, user, spec, code, *needles, name="bad.yaml"):
        """Submitting `spec` as `user` exits `code` with every needle in the error, and
        stores no job."""
        before = self.job_count()
        r = self.expect(code, user, "submit", self.user_spec(user, spec, name))
        for needle in needles:
            self.assertIn(needle, r.stderr)
        self.assertEqual(self.job_count(), before, "a refused job was stored")
        return r

    def job_count(self):
        return sum(len(page.get("jobs", [])) for page in self.cli_json_lines("list", "--all-pages"))

    def audit(self, *args):
        return [json.loads(line) for line in
                self.expect(EXIT_OK, CAROL, "-o", "json", "audit", *args).stdout.splitlines()]


class IdentityAndPermissionTest(SharingTestCase):

    def test_whoami_is_the_kernels_answer(self):
        me = self.json_as(ALICE, "whoami")
        self.assertEqual(me["user"], ALICE)
        self.assertEqual(int(me["uid"]), pwd.getpwnam(ALICE).pw_uid)
        self.assertFalse(me["admin"])
        self.assertEqual(me["authenticated_by"], "unix socket peer credentials")
        carol = self.json_as(CAROL, "whoami")
        self.assertTrue(carol["admin"])
        self.assertIn(ADMINS, carol["groups"])
        self.assertTrue(self.cli_json("whoami")["admin"])  # root
        self.assertEqual(self.json_as(BOB, "whoami")["user"], BOB)

    def test_permission_matrix_and_audit(self):
        a = self.submit_as(ALICE, make_spec(steps=5, name="alices", data="data.jsonl"), "--hold")
        b = self.submit_as(BOB, make_spec(steps=5, name="bobs", data="data.jsonl"), "--hold")
        self.assertEqual(self.status(a)["owner"], ALICE)
        self.assertEqual(int(self.status(a)["owner_uid"]), pwd.getpwnam(ALICE).pw_uid)
        # Everyone reads the queue and each job.
        for user in (ALICE, BOB, CAROL):
            pages = self.expect(EXIT_OK, user, "-o", "json", "list").stdout.splitlines()
            ids = [int(j["id"]) for page in pages for j in json.loads(page).get("jobs", [])]
            self.assertIn(a, ids)
            self.assertIn(b, ids)
            self.assertEqual(self.json_as(user, "status", a)["name"], "alices")
        # Others may not change a job.
        for verb in ("release", "hold", "cancel", "checkpoint"):
            r = self.expect(EXIT_PERMISSION, BOB, verb, a)
            self.assertIn(f"job {a} belongs to {ALICE}", r.stderr)
            self.assertIn(f"group {ADMINS}", r.stderr)
        self.assertEqual(self.status(a)["state"], "JOB_STATE_HELD")
        # The owner may; an admin may.
        self.expect(EXIT_OK, ALICE, "cancel", a)
        self.expect(EXIT_OK, CAROL, "cancel", b)
        self.assertEqual(self.status(b)["state"], "JOB_STATE_CANCELLED")
        # The audit: every mutating call, refused ones too, with the outcome.
        log = self.audit("--job", a)
        denied = [e for e in log if e["user"] == BOB]
        self.assertEqual(sorted(e["action"] for e in denied),
                         ["cancel", "checkpoint", "hold", "release"])
        for e in denied:
            self.assertTrue(e["outcome"].startswith("PERMISSION_DENIED: "), e)
        self.assertIn({"user": ALICE, "action": "cancel", "outcome": "ok"},
                      [{k: e[k] for k in ("user", "action", "outcome")} for e in log])
        self.assertIn("submit", [e["action"] for e in log if e["user"] == ALICE])
        cancelled_b = [e for e in self.audit("--user", CAROL) if e["action"] == "cancel"]
        self.assertEqual(int(cancelled_b[0]["job_id"]), b)
        # Only admins read the audit.
        r = self.expect(EXIT_PERMISSION, ALICE, "audit")
        self.assertIn("for admins", r.stderr)

    def test_checkpoint_of_a_running_job_by_owner_only_and_files_are_theirs(self):
        ck = home(ALICE, "ck")
        a = self.submit_as(ALICE, make_spec(steps=100000, name="long", checkpoint={"dir": ck}))
        self.wait_running_at(a, 2)
        self.expect(EXIT_PERMISSION, BOB, "checkpoint", a)
        path = self.json_as(ALICE, "checkpoint", a)["path"]
        self.assertTrue(path.startswith(ck + "/checkpoint-"), path)
        uid = pwd.getpwnam(ALICE).pw_uid
        for dirpath, _, files in os.walk(ck):
            self.assertEqual(os.stat(dirpath).st_uid, uid, dirpath)
            for f in files:
                self.assertEqual(os.stat(os.path.join(dirpath, f)).st_uid, uid, f)
        self.expect(EXIT_OK, CAROL, "cancel", a)  # an admin stops anyone's job

    def test_default_checkpoint_folder_belongs_to_the_user(self):
        a = self.submit_as(ALICE, make_spec(steps=3, name="default-dir"))
        self.watch_ok(a)
        job_dir = os.path.join(self.daemon.state_dir, "jobs", str(a))
        st = os.stat(job_dir)
        self.assertEqual(st.st_uid, pwd.getpwnam(ALICE).pw_uid)
        self.assertEqual(st.st_mode & 0o777, 0o700)
        last = self.status(a)["last_checkpoint"]
        self.assertTrue(last.startswith(job_dir), last)
        self.assertEqual(os.stat(os.path.join(last, "model.safetensors")).st_uid,
                         pwd.getpwnam(ALICE).pw_uid)
        # The database is the daemon's alone.
        self.assertEqual(os.stat(os.path.join(self.daemon.state_dir, "megatrain.db")).st_mode
                         & 0o777, 0o600)


class FilesTest(SharingTestCase):
    """A job spec can never make the daemon read or write another user's files."""

    def test_cannot_read_another_users_data_or_config(self):
        spec = make_spec(steps=2, data=home(ALICE, "data.jsonl"))
        self.refused(BOB, spec, EXIT_PERMISSION, "data.path", "Permission denied")
        # The same file through a link in bob's own home.
        link = home(BOB, "alices-data.jsonl")
        os.symlink(home(ALICE, "data.jsonl"), link)
        self.refused(BOB, make_spec(steps=2, data=link), EXIT_PERMISSION, "data.path")
        # A config.json read at parse time, as the user.
        config = home(ALICE, "config.json")
        with open(config, "w") as f:
            json.dump({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                       "intermediate_size": 160, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2,
                       "vocab_size": 258}, f)
        chown(config, ALICE, 0o600)
        spec = make_spec(steps=2)
        spec["model"] = {"config_path": config}
        r = self.as_user(BOB, "submit", self.user_spec(BOB, spec, "cfg.yaml"))
        self.assertNotEqual(r.returncode, EXIT_OK, r.stdout)
        self.assertIn("config", r.stderr)
        # Alice herself may.
        ok = make_spec(steps=2)
        ok["model"] = {"config_path": config}
        self.submit_as(ALICE, ok, "--hold", name="cfg.yaml")

    def test_cannot_read_another_users_model(self):
        # Alice's checkpoint is a Hugging Face model folder, hers alone.
        ck = home(ALICE, "models")
        a = self.submit_as(ALICE, make_spec(steps=2, name="make-model", checkpoint={"dir": ck}))
        self.watch_ok(a)
        model = self.status(a)["last_checkpoint"]
        self.assertTrue(os.path.isfile(os.path.join(model, "model.safetensors")), model)
        spec = make_spec(steps=2)
        spec["model"] = {"path": model}
        self.refused(BOB, spec, EXIT_PERMISSION, "model.path")
        self.submit_as(ALICE, spec, "--hold", name="finetune.yaml")  # she may

    def test_cannot_write_into_another_users_folders(self):
        os.makedirs(home(ALICE, "open"), exist_ok=True)
        chown(home(ALICE, "open"), ALICE, 0o755)
        os.chmod(home(ALICE), 0o755)  # bob can look in, not write
        try:
            for field, spec in (
                    ("checkpoint.dir", make_spec(steps=2, checkpoint={"dir": home(ALICE, "open", "ck")})),
                    ("checkpoint.dir", make_spec(steps=2, checkpoint={"dir": home(ALICE, "open")})),
                    ("data.cache_dir", dict(make_spec(steps=2), data={
                        "path": "data.jsonl", "tokenizer": "byte", "seq_len": 32,
                        "cache_dir": home(ALICE, "open")}))):
                self.refused(BOB, spec, EXIT_PERMISSION, field)
            self.assertEqual(os.listdir(home(ALICE, "open")), [])
        finally:
            os.chmod(home(ALICE), 0o700)

    def test_roots_and_the_state_folder_are_enforced(self):
        outside = os.path.join(ROOT, "outside", "data.jsonl")  # world-readable
        self.refused(BOB, make_spec(steps=2, data=outside), EXIT_PERMISSION,
                     "outside the folders this daemon works in")
        into_state = make_spec(steps=2, checkpoint={"dir": os.path.join(self.daemon.state_dir, "x")})
        self.refused(ALICE, into_state, EXIT_PERMISSION, "checkpoint.dir")
        # Root (an admin) is held to the roots too.
        r = self.cli("submit", self.spec_file(make_spec(steps=2, data=outside), "root.yaml"))
        self.assertEqual(r.returncode, EXIT_PERMISSION, r.stderr)

    def test_a_link_swapped_in_after_submission_is_caught_at_start(self):
        data = home(BOB, "mine.jsonl")
        shutil.copy(home(BOB, "data.jsonl"), data)
        chown(data, BOB, 0o600)
        b = self.submit_as(BOB, make_spec(steps=2, data=data), "--hold")
        os.remove(data)
        os.symlink(home(ALICE, "data.jsonl"), data)
        self.expect(EXIT_OK, BOB, "release", b)
        job = self.wait_state(b, "failed")
        self.assertIn("data.path", job["error"])

    def test_a_checkpoint_dir_swapped_for_a_link_while_held_writes_nothing_there(self):
        # Bob's checkpoint folder becomes, while his job is held, a link into Alice's home:
        # his worker, running as him, is refused by the kernel when the job starts.
        theirs = home(ALICE, "ckpts")
        os.makedirs(theirs, exist_ok=True)
        chown(theirs, ALICE, 0o700)
        ck = home(BOB, "ck")
        b = self.submit_as(BOB, make_spec(steps=2, checkpoint={"dir": ck}), "--hold")
        shutil.rmtree(ck, ignore_errors=True)
        os.symlink(theirs, ck)
        self.expect(EXIT_OK, BOB, "release", b)
        job = self.wait_state(b, "failed")
        self.assertIn("checkpoint.dir", job["error"])
        self.assertEqual(os.listdir(theirs), [])


class SchedulingTest(SharingTestCase):
    LIMITS = {"max_queued_jobs": 2, "max_priority": 10}

    def test_priority_ceiling_and_queued_job_limit(self):
        r = self.expect(EXIT_PERMISSION, ALICE, "submit",
                        self.user_spec(ALICE, make_spec(steps=2)), "--priority", "50")
        self.assertIn("priority 50 is above", r.stderr)
        self.assertIn("admins", r.stderr)
        self.submit_as(CAROL, make_spec(steps=2, name="urgent"), "--priority", "50", "--hold")
        self.submit_as(BOB, make_spec(steps=2, name="b1"), "--hold")
        self.submit_as(BOB, make_spec(steps=2, name="b2"), "--hold")
        self.refused(BOB, make_spec(steps=2, name="b3"), EXIT_RESOURCE_EXHAUSTED,
                     "2 jobs queued or held", "max_queued_jobs")
        usage = {u["user"]: u for u in self.json_as(ALICE, "usage")["users"]}
        self.assertEqual(usage[BOB]["queued_jobs"], 2)
        self.assertEqual(usage[BOB]["max_queued_jobs"], 2)

    def test_fair_share_runs_the_user_with_less_recent_use_first(self):
        # Alice has used the device; bob has not.
        self.watch_ok(self.submit_as(ALICE, make_spec(steps=30, name="warm")))
        usage = {u["user"]: u for u in self.json_as(BOB, "usage")["users"]}
        self.assertGreater(usage[ALICE]["gpu_hours"], 0)
        self.assertNotIn(BOB, usage)
        # While a job of root's holds the device, alice queues first, then bob.
        blocker = self.submit(make_spec(steps=100000, name="blocker"))
        self.wait_running_at(blocker, 1)
        a = self.submit_as(ALICE, make_spec(steps=3, name="a"))
        b = self.submit_as(BOB, make_spec(steps=3, name="b"))
        self.cli_ok("cancel", blocker)
        self.watch_ok(a)
        self.watch_ok(b)
        ja, jb = self.status(a), self.status(b)
        self.assertLess(int(jb["started_unix_ms"]), int(ja["started_unix_ms"]),
                        "bob (no recent use) should start before alice's older job")

    def test_preempted_job_resumes_with_no_lost_steps(self):
        steps = 200
        low_spec = make_spec(steps=steps, name="low", data="data.jsonl",
                             checkpoint={"every_steps": 1000})
        low = self.submit_as(ALICE, low_spec)
        self.wait_running_at(low, 5)
        high = self.submit_as(BOB, make_spec(steps=3, name="high"), "--priority", "5")
        self.watch_ok(high, timeout=WAIT_S * 3)
        job = self.wait_state(low, "succeeded", timeout=WAIT_S * 3)
        self.assertEqual(int(job["preemptions"]), 1)
        self.assertEqual(step_of(job), steps)
        texts = self.log_texts(low)
        preempted = [t for t in texts if t.startswith("preempted by job")]
        self.assertEqual(len(preempted), 1, texts)
        self.assertIn(f"job {high} of {BOB}", preempted[0])
        at = int(re.search(r"checkpointed at step (\d+)", preempted[0]).group(1))
        self.assertEqual(resumed_step(texts), at, "resumed from another step than preempted at")
        # The high-priority job ran while the low one waited.
        jh = self.status(high)
        self.assertLess(int(jh["finished_unix_ms"]), int(job["finished_unix_ms"]))
        # Nothing was lost: the final state equals a run never interrupted.
        local = dict(low_spec, checkpoint={"dir": "local-ck", "every_steps": 1000})
        shutil.copy(home(ALICE, "data.jsonl"), os.path.join(self.tmp, "data.jsonl"))
        self.run_local(local, "local.yaml")
        want = max((d for d in os.listdir(os.path.join(self.tmp, "local-ck"))
                    if d.startswith("checkpoint-")), key=lambda d: int(d.split("-")[1]))
        got, want = job["last_checkpoint"], os.path.join(self.tmp, "local-ck", want)
        for rel in CHECKPOINT_FILES:
            with open(os.path.join(got, rel), "rb") as f, open(os.path.join(want, rel), "rb") as g:
                a, b = f.read(), g.read()
            if rel == "trainer_state.json":  # the data file's path differs, nothing else
                a, b = json.loads(a), json.loads(b)
                for state in (a, b):
                    state["spec_fingerprint"] = json.loads(state["spec_fingerprint"])
                    state["spec_fingerprint"].pop("data_path")
            self.assertTrue(a == b, f"{rel} differs between {got} and {want}")


class LanesTest(SharingTestCase):
    """Two lanes (--device cpu,cpu: what two GPUs are, on a machine without one): each runs
    its own job from the one queue; per-user running limits and preemption across lanes."""

    LIMITS = {"max_running_jobs": 1, "max_priority": 10}

    def daemon_args(self):
        return (*super().daemon_args(), "--device", "cpu,cpu")

    def running(self):
        pages = self.cli_json_lines("list", "--state", "running")
        return {int(j["id"]): j for page in pages for j in page.get("jobs", [])}

    def test_two_lanes_run_two_users_and_a_user_waits_at_their_running_limit(self):
        a1 = self.submit_as(ALICE, make_spec(steps=100000, name="a1"))
        self.wait_running_at(a1, 1)
        a2 = self.submit_as(ALICE, make_spec(steps=100000, name="a2"))
        b1 = self.submit_as(BOB, make_spec(steps=100000, name="b1"))
        # bob's job takes the second lane; alice's second waits, saying why.
        self.wait_running_at(b1, 1)
        waiting = self.wait_for(a2, lambda j: j.get("waiting", ""), "waiting with a reason")
        self.assertEqual(waiting["state"], "JOB_STATE_QUEUED")
        self.assertIn(f"{ALICE} has 1 running jobs, the most allowed", waiting["waiting"])
        self.assertEqual(set(self.running()), {a1, b1})
        # When alice's first ends, her second runs, and no longer waits.
        self.expect(EXIT_OK, ALICE, "cancel", a1)
        started = self.wait_running_at(a2, 1)
        self.assertEqual(started["waiting"], "")
        for job in (a2, b1):
            self.cli_ok("cancel", job)

    def test_preemption_takes_the_lane_of_the_lowest_priority_job(self):
        low = self.submit_as(ALICE, make_spec(steps=100000, name="low"), "--priority", "0")
        mid = self.submit_as(BOB, make_spec(steps=100000, name="mid"), "--priority", "1")
        self.wait_running_at(low, 2)
        self.wait_running_at(mid, 2)
        high = self.submit_as(CAROL, make_spec(steps=5, name="high"), "--priority", "5")
        self.watch_ok(high)
        # low stepped aside (and is back, resumed), mid never did. Its record says running
        # as its lane takes it, before its worker has resumed and logged it: wait for that.
        self.wait_running_at(low, 1)
        deadline = time.monotonic() + WAIT_S
        while resumed_step(self.log_texts(low)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(int(self.status(low)["preemptions"]), 1)
        self.assertEqual(int(self.status(mid)["preemptions"]), 0)
        self.assertTrue(any(t.startswith(f"preempted by job {high}") for t in self.log_texts(low)))
        self.assertIsNotNone(resumed_step(self.log_texts(low)))
        for job in (low, mid):
            self.cli_ok("cancel", job)


class TokenTest(SharingTestCase):
    """TCP with TLS and per-user tokens."""

    def tcp(self, user, token, *args, code=EXIT_OK):
        env = {"MEGATRAIN_TLS_CA": os.path.join(ROOT, "tls", "cert.pem")}
        if token is not None:
            env["MEGATRAIN_TOKEN"] = token
        return self.expect(code, user, "--addr", f"127.0.0.1:{self.port}", *args, env=env)

    def test_tokens_stand_for_their_user_over_tls(self):
        created = self.json_as(ALICE, "token", "create", "--name", "laptop")
        secret = created["secret"]
        self.assertTrue(secret.startswith("mt_"))
        me = json.loads(self.tcp(BOB, secret, "-o", "json", "whoami").stdout)
        # The token decides, not the account that runs the CLI.
        self.assertEqual(me["user"], ALICE)
        self.assertEqual(me["authenticated_by"], f"token {created['token']['id']}")
        # Submitting and the permission matrix over TCP.
        spec = self.user_spec(ALICE, make_spec(steps=2, name="over-tcp"), "tcp.yaml")
        job = json.loads(self.tcp(ALICE, secret, "-o", "json", "submit", spec, "--hold").stdout)
        self.assertEqual(job["owner"], ALICE)
        bobs = self.json_as(BOB, "token", "create")["secret"]
        r = self.tcp(BOB, bobs, "cancel", job["id"], code=EXIT_PERMISSION)
        self.assertIn(f"belongs to {ALICE}", r.stderr)
        # A token cannot mint more: that happens only where the kernel vouches for the caller.
        r = self.tcp(ALICE, secret, "token", "create", code=EXIT_PERMISSION)
        self.assertIn("over the Unix socket", r.stderr)
        # No token, a wrong one.
        r = self.tcp(ALICE, None, "list", code=EXIT_PERMISSION)
        self.assertIn("needs a token", r.stderr)
        self.tcp(ALICE, "mt_" + "0" * 64, "list", code=EXIT_PERMISSION)
        # Only the hash is stored.
        db = sqlite3.connect(os.path.join(self.daemon.state_dir, "megatrain.db"))
        stored = [row[0] for row in db.execute("SELECT hash FROM tokens")]
        db.close()
        self.assertEqual(len(stored), 2)
        self.assertNotIn(secret, stored)
        # Bob cannot revoke alice's token; alice can; then it no longer works.
        self.expect(EXIT_PERMISSION, BOB, "token", "revoke", created["token"]["id"])
        self.expect(EXIT_OK, ALICE, "token", "revoke", created["token"]["id"])
        r = self.tcp(ALICE, secret, "list", code=EXIT_PERMISSION)
        self.assertIn("not valid", r.stderr)
        # Admins see everyone's tokens and may mint for a user.
        self.assertEqual(len(self.json_as(CAROL, "token", "list", "--user", "*")["tokens"]), 1)
        self.expect(EXIT_PERMISSION, BOB, "token", "create", "--user", ALICE)
        minted = self.json_as(CAROL, "token", "create", "--user", ALICE)["secret"]
        self.assertEqual(json.loads(self.tcp(CAROL, minted, "-o", "json", "whoami").stdout)["user"],
                         ALICE)
        actions = [e["action"] for e in self.audit()]
        self.assertIn("create-token", actions)
        self.assertIn("revoke-token", actions)


if __name__ == "__main__":
    unittest.main()
