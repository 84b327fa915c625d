"""bench/'s Nsight Compute readers on CSVs as ncu writes them: ncu_kernel_times.py's kernel
names, sums and classes, and ncu_pipes.py on a real run's CSV."""

import os
import subprocess
import sys
import tempfile
import unittest

_HERE = os.path.dirname(os.path.abspath(__file__))
_BENCH = os.path.join(_HERE, "..", "..", "bench")
sys.path.insert(0, _BENCH)
import ncu_kernel_times  # noqa: E402

# A real ncu --set full --page raw --csv of one kernel (the Hopper dq pass on an H200).
_REAL = os.path.join(_HERE, "data", "ncu_dq_d128.csv")

_PREAMBLE = ("==PROF== Connected to process 1 (train_bench)\n"
             "==WARNING== Note: Running with unmodified GPU clocks.\n\n")


def write_csv(path, unit, kernels):
    """kernels: (name, duration) pairs, in a raw CSV of the one metric."""
    with open(path, "w") as f:
        f.write(_PREAMBLE)
        f.write('"ID","Process ID","Kernel Name","gpu__time_duration.sum"\n')
        f.write(f'"","","","{unit}"\n')
        for i, (name, duration) in enumerate(kernels):
            f.write(f'"{i}","1","{name}","{duration}"\n')


class KernelTimesTest(unittest.TestCase):
    def test_short_names(self):
        cases = {
            "void megatrain::cuda::(anonymous namespace)::RmsNormKernel<128, (bool)1>"
            "(const __nv_bfloat16 *, float)": "RmsNormKernel",
            "void unnamed>::HopperDqKernel<128, 0>(CUtensorMap_st, float)": "HopperDqKernel",
            "void <unnamed>::SwiGlu<std::pair<int, float>>(float *)": "SwiGlu",
            "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1":
                "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1",
            "nvjet_tst_192x192_64x4_2x1_v_bz_coopA_NTN": "nvjet_tst_192x192_64x4_2x1_v_bz_coopA_NTN",
        }
        for name, short in cases.items():
            self.assertEqual(ncu_kernel_times.short_name(name), short, name)

    def test_sums_by_kernel_and_class(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.csv")
            write_csv(path, "usecond", [
                ("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_NTN", "1,500.5"),
                ("void ns::RmsNormKernel<1>(float *)", "100"),
                ("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_NTN", "1,499.5"),
                ("void unnamed>::HopperForwardKernel<128, 0, 0>(CUtensorMap_st)", "900"),
                ("void ns::RmsNormKernel<2>(float *)", "0"),
            ])
            s = ncu_kernel_times.summarise(path)
        self.assertAlmostEqual(s["total_ms"], 4.0)
        first = s["kernels"][0]
        self.assertEqual((first["class"], first["launches"]), ("matmul", 2))
        self.assertAlmostEqual(first["total_ms"], 3.0)
        self.assertAlmostEqual(first["share"], 0.75)
        norms = next(k for k in s["kernels"] if k["kernel"] == "RmsNormKernel")
        self.assertEqual(norms["launches"], 2)  # both instantiations under one name
        self.assertAlmostEqual(norms["mean_us"], 50.0)
        self.assertEqual(list(s["classes"]), ["matmul", "attention", "other"])
        self.assertAlmostEqual(s["classes"]["attention"]["total_ms"], 0.9)

    def test_without_durations_says_so(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.csv")
            with open(path, "w") as f:
                f.write('"ID","Kernel Name","sm__cycles_elapsed.avg"\n"","","cycle"\n"0","k","5"\n')
            with self.assertRaises(SystemExit) as e:
                ncu_kernel_times.summarise(path)
        self.assertIn("gpu__time_duration.sum", str(e.exception))

    def test_unknown_unit_says_so(self):  # rather than summing nothing
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.csv")
            write_csv(path, "cycle", [("void k()", "5")])
            with self.assertRaises(SystemExit) as e:
                ncu_kernel_times.summarise(path)
        self.assertIn("unknown unit 'cycle'", str(e.exception))

    def test_real_csv(self):
        s = ncu_kernel_times.summarise(_REAL)
        self.assertEqual([k["kernel"] for k in s["kernels"]], ["HopperDqKernel"])
        self.assertAlmostEqual(s["total_ms"], 19.218496)
        p = subprocess.run([sys.executable, os.path.join(_BENCH, "ncu_pipes.py"), _REAL],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("gpu__time_duration.sum 19,218,496", p.stdout)
        self.assertIn("stall smsp__average_warps_issue_stalled", p.stdout)


if __name__ == "__main__":
    unittest.main()
