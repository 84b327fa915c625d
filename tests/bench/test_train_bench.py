"""train_bench on the CPU backend, with a tiny MoE model: the flags that diagnose a step
(--no-optimizer, --timeline) and the floors its JSON reports; and --plan-only for a GPU box
from its saved profile, on this machine without the GPU.

The binaries are found under $MEGATRAIN_BIN_DIR (the CMake build folder), else ../../build.
"""

import json
import os
import subprocess
import tempfile
import unittest

_HERE = os.path.dirname(os.path.abspath(__file__))
BIN_DIR = os.path.abspath(
    os.environ.get("MEGATRAIN_BIN_DIR") or os.path.join(_HERE, "..", "..", "build"))
TRAIN_BENCH = os.path.join(BIN_DIR, "bench", "train_bench")
# An H200 box's saved machine profile (machine_bench --save).
H200_PROFILE = os.path.join(_HERE, "data", "h200_machine_profile.json")


class TrainBenchTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        # One machine profile for every run (measured once, about 10 s on two cores).
        cls.profile = os.path.join(cls.tmp.name, "profile.json")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def run_bench(self, *flags, profile=None):
        args = [TRAIN_BENCH, "--backend", "cpu", "--shape", "tiny-moe", "--seq", "64",
                "--tokens-per-step", "256", "--steps", "3", "--warmup", "1",
                "--profile", profile or self.profile, *flags]
        p = subprocess.run(args, capture_output=True, text=True, timeout=240)
        self.assertEqual(p.returncode, 0, p.stderr)
        return json.loads(p.stdout)

    def test_adamw_updates_and_the_schedule_floor(self):
        timeline = os.path.join(self.tmp.name, "timeline.json")
        r = self.run_bench("--timeline", timeline)
        self.assertEqual(r["optimizer"], "CPU AdamW")
        losses = [s["loss"] for s in r["steps"]]
        self.assertNotEqual(losses[0], losses[-1])  # the same batches, updated weights
        floors = r["floors_seconds"]
        largest = max(floors["gpu_kernels"], floors["pcie"], floors["cpu_optimizer"])
        # The ideal schedule of the measured stages: slower than the GPU's kernels alone
        # (the embedding's and layer 0's updates come after the backward and before the next
        # forward) and than the optimizer plus the head (its gradient lands first, only
        # after the whole forward).
        self.assertGreaterEqual(r["schedule_floor_seconds"], largest)
        steady = r["steps"][-r["steady_steps"]:]
        head = min(s["compute_seconds_by_stage"]["head"] for s in steady)
        self.assertGreater(r["schedule_floor_seconds"],
                           max(floors["gpu_kernels"], floors["cpu_optimizer"] + head))
        self.assertAlmostEqual(r["step_over_schedule_floor"],
                               r["step_seconds"] / r["schedule_floor_seconds"], places=9)
        self.assertLessEqual(r["step_over_schedule_floor"], r["step_over_largest_floor"])
        # AdamW's rate in the step over the profile's (what the planner scales by): some.
        self.assertGreater(r["optimizer_in_step_fraction"], 0)
        # The last step's spans: every layer's forward and backward, the head, on the
        # compute stream (0), each ending after it starts.
        spans = json.load(open(timeline))
        labels = {s["label"] for s in spans if s["stream"] == 0}
        layers = r["model"]["layers"]
        for l in range(layers):
            self.assertIn(f"fwd {l}", labels)
            self.assertIn(f"bwd {l}", labels)
        self.assertIn("head", labels)
        self.assertTrue(all(s["end_ms"] >= s["start_ms"] for s in spans))
        # The optimizer's pieces (stream 3, the host's clock): AdamW of every unit (the
        # embedding 0, the layers, the head), each after its gradient landed; and their
        # rates over the steady steps.
        pieces = [s for s in spans if s["stream"] == 3]
        units = {int(s["label"].split()[1]) for s in pieces if s["label"].startswith("adamw ")}
        self.assertTrue(set(range(layers + 1)) <= units, units)
        for s in pieces:
            self.assertLessEqual(s["start_ms"], s["ready_ms"])
            self.assertLessEqual(s["ready_ms"], s["end_ms"])
            self.assertGreater(s["params"], 0)
        rates = r["optimizer_pieces"]["params_per_second"]
        self.assertGreater(r["optimizer_pieces"]["pieces"], 0)
        self.assertTrue(0 < rates["min"] <= rates["median"] <= rates["max"], rates)

    def test_no_optimizer_updates_nothing(self):
        r = self.run_bench("--no-optimizer")
        self.assertEqual(r["optimizer"], "none (gradients discarded)")
        losses = [s["loss"] for s in r["steps"]]
        self.assertEqual(len(set(losses)), 1, losses)  # the same batches, the same weights
        self.assertEqual(r["floors_seconds"]["cpu_optimizer"], 0)
        self.assertEqual(r["optimizer_in_step_fraction"], 0)
        self.assertEqual(r["optimizer_pieces"]["pieces"], 0)

    def test_calibrate_writes_the_steps_adamw_fraction_into_the_profile(self):
        profile = os.path.join(self.tmp.name, "calibrated.json")
        r = self.run_bench("--calibrate", profile=profile)
        measured = r["optimizer_in_step_fraction"]
        self.assertGreater(measured, 0)
        with open(profile) as f:
            saved = json.load(f)
        self.assertAlmostEqual(saved["adamw_in_step_fraction"], min(2.0, measured), places=9)
        # The next plan takes it: AdamW's time at the profile's rate times the fraction.
        again = self.run_bench(profile=profile)
        rate = saved["adamw_params_per_second"] * saved["adamw_in_step_fraction"]
        if not again["plan"]["bf16_copy"]:
            rate *= 30 / 28
        self.assertAlmostEqual(again["plan"]["predicted_optimizer_seconds"],
                               again["model"]["params"] / rate,
                               delta=0.02 * again["plan"]["predicted_optimizer_seconds"])
        bad = subprocess.run([TRAIN_BENCH, "--backend", "cpu", "--shape", "tiny-moe",
                              "--calibrate", "--no-optimizer", "--profile", profile],
                             capture_output=True, text=True, timeout=60)
        self.assertEqual(bad.returncode, 2)
        self.assertIn("--calibrate", bad.stderr)

    def run_plan(self, *flags):
        args = [TRAIN_BENCH, "--backend", "cuda", "--plan-only", "--shape", "qwen3-30b-a3b",
                "--layers", "4", "--seq", "4096", "--tokens-per-step", "65536", *flags]
        return subprocess.run(args, capture_output=True, text=True, timeout=120)

    @unittest.skipIf(os.path.exists("/dev/nvidia0"), "a GPU here: --plan-only would use it")
    def test_plan_only_plans_for_a_gpu_box_from_its_saved_profile(self):
        p = self.run_plan("--profile", H200_PROFILE)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("planning for the box of", p.stderr)
        r = json.loads(p.stdout)
        with open(H200_PROFILE) as f:
            profile = json.load(f)
        plan = r["plan"]
        self.assertGreater(plan["predicted_step_seconds"], 0)
        self.assertLessEqual(plan["predicted_device_gib"],
                             profile["device_memory_bytes"] / 2**30)
        # The H200's AdamW rate, at the in-step fraction (the profile has none: 0.70), for
        # 30 bytes a parameter with the bf16 copy and 28 without.
        rate = profile["adamw_params_per_second"] * 0.70 * (1 if plan["bf16_copy"] else 30 / 28)
        self.assertAlmostEqual(plan["predicted_optimizer_seconds"], r["parameters"] / rate,
                               delta=1e-3 * plan["predicted_optimizer_seconds"])
        # A cap on the device memory plans within it.
        capped = self.run_plan("--profile", H200_PROFILE, "--device-memory-gib", "40")
        self.assertEqual(capped.returncode, 0, capped.stderr)
        self.assertLessEqual(json.loads(capped.stdout)["plan"]["predicted_device_gib"], 40)

    @unittest.skipIf(os.path.exists("/dev/nvidia0"), "a GPU here: --plan-only would use it")
    def test_plan_only_without_the_device_or_a_gpu_profile_says_why(self):
        missing = self.run_plan("--profile", os.path.join(self.tmp.name, "none.json"))
        self.assertEqual(missing.returncode, 1)
        self.assertIn("no machine profile at", missing.stderr)
        self.run_bench()  # writes the CPU's profile
        cpu = self.run_plan("--profile", self.profile)
        self.assertEqual(cpu.returncode, 1)
        self.assertIn("its backend is cpu", cpu.stderr)


if __name__ == "__main__":
    unittest.main()
