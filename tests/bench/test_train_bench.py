"""train_bench on the CPU backend, with a tiny MoE model: the flags that diagnose a step
(--no-optimizer, --timeline) and the floors its JSON reports.

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


class TrainBenchTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        # One machine profile for every run (measured once, about 10 s on two cores).
        cls.profile = os.path.join(cls.tmp.name, "profile.json")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def run_bench(self, *flags):
        args = [TRAIN_BENCH, "--backend", "cpu", "--shape", "tiny-moe", "--seq", "64",
                "--tokens-per-step", "256", "--steps", "3", "--warmup", "1",
                "--profile", self.profile, *flags]
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

    def test_no_optimizer_updates_nothing(self):
        r = self.run_bench("--no-optimizer")
        self.assertEqual(r["optimizer"], "none (gradients discarded)")
        losses = [s["loss"] for s in r["steps"]]
        self.assertEqual(len(set(losses)), 1, losses)  # the same batches, the same weights
        self.assertEqual(r["floors_seconds"]["cpu_optimizer"], 0)
        self.assertEqual(r["optimizer_in_step_fraction"], 0)


if __name__ == "__main__":
    unittest.main()
