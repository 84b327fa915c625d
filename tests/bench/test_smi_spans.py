"""bench/smi_spans.py: the card's clock and power over marked spans, on a real nvidia-smi log of
an H200 (machine_bench and two steps) and on a synthetic one with clock-event reasons."""

import gzip
import os
import shutil
import sys
import tempfile
import unittest

_HERE = os.path.dirname(os.path.abspath(__file__))
_BENCH = os.path.join(_HERE, "..", "..", "bench")
sys.path.insert(0, _BENCH)
import smi_spans  # noqa: E402

_DATA = os.path.join(_HERE, "data")


class SmiSpansTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def test_a_real_run(self):
        smi = os.path.join(self.tmp, "smi.csv")
        with gzip.open(os.path.join(_DATA, "smi_held.csv.gz"), "rb") as f, \
                open(smi, "wb") as out:
            shutil.copyfileobj(f, out)
        spans = {s["span"]: s for s in smi_spans.spans(smi, os.path.join(_DATA, "smi_marks.txt"))}
        # What smi_spans.py printed on the box.
        llama = spans["step_llama8b_8k_128k_held"]
        self.assertEqual(llama["busy_samples"], 426)
        self.assertEqual(llama["sm_mhz"]["median"], 1560.0)
        self.assertAlmostEqual(llama["watts"]["median"], 693.45)
        self.assertEqual(spans["machine_bench"]["sm_mhz"]["median"], 1965.0)

    def test_busy_samples_and_reasons(self):
        smi = os.path.join(self.tmp, "smi.csv")
        with open(smi, "w") as f:
            f.write("timestamp, utilization.gpu [%], clocks.current.sm [MHz], power.draw [W], "
                    "clocks_event_reasons.sw_power_cap\n")
            f.write("2026/12/03 13:00:00.000, 100 %, 1500 MHz, 690.00 W, Active\n")
            f.write("2026/12/03 13:00:00.100, 95 %, 1600 MHz, 650.00 W, Not Active\n")
            f.write("2026/12/03 13:00:00.200, 10 %, 1980 MHz, 150.00 W, Not Active\n")
            f.write("2026/12/03 13:00:01.000, 100 %, 1400 MHz, 700.00 W, Active\n")  # outside
            f.write("a line nvidia-smi did not finish\n")
        marks = os.path.join(self.tmp, "marks.txt")
        with open(marks, "w") as f:
            f.write("2026/12/03 12:59:59.900 start a\n2026/12/03 13:00:00.300 end a\n"
                    "2026/12/03 13:00:00.300 end never-started\n")
        (a,) = smi_spans.spans(smi, marks)
        self.assertEqual((a["span"], a["samples"], a["busy_samples"]), ("a", 3, 2))
        self.assertEqual(a["sm_mhz"]["median"], 1600.0)
        self.assertEqual(a["sm_mhz"]["p10"], 1500.0)
        self.assertEqual(a["sw_power_cap_share"], 0.5)


if __name__ == "__main__":
    unittest.main()
