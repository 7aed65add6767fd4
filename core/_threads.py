"""OpenMP wait settings that share the CPU fairly, applied before torch loads its OpenMP runtime.

PyTorch's CPU build uses libgomp, whose idle threads spin 300,000 times before sleeping. Beside another busy
process on the same cores that spinning takes the cores the other needs: on a 2-core CPU one fused answer took
3.7-4.9 s instead of about 1.1 s. Bounded to 10,000 spins it took about as long alone and 2.2-3.8 s beside the
same process, about its share; `OMP_WAIT_POLICY=PASSIVE` costs 25-70 % alone (`benchmarks/bench_contention.py`,
`reports/reliability.md`).
"""
from __future__ import annotations

import os
import sys

SPIN_COUNT = "10000"


def bound_openmp_spinning() -> bool:
    """Set GOMP_SPINCOUNT unless the user chose a wait setting or torch (and its OpenMP) is already loaded."""
    if "torch" in sys.modules or "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return False
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True
