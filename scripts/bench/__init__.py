"""The benchmark's parts; ``scripts/benchmark.py`` is the command line that runs them.

workloads.py  the requests: seeded token-id prompts and budgets per workload (seed, scale, sweep)
systems.py    the systems run on them: static_hf, hf_cb, ours (ours:int8 ...), llamacpp, ours_ray
roofline.py   inside the ours worker: engine overhead over the bare forward, the roofline, kernel rates
report.py     per-request timings -> summaries; tables, JSON and plots
"""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
