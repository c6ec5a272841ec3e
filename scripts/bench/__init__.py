"""The benchmark's parts; ``scripts/benchmark.py`` is the command line that runs them.

workloads.py  the requests: seeded token-id prompts and budgets per workload (seed, scale, sweep); drive
systems.py    the systems run on them: ours (ours:int8 ...), ours_server, ours_ray; the registry of every system
hf_systems.py the HF baselines: static_hf, hf_cb
llamacpp.py   llama.cpp's llama-server
servers.py    server processes: port, log, bounded health wait, peak RSS, stop
roofline.py   inside the ours worker: engine overhead over the bare forward, the roofline, kernel rates
report.py     per-request timings -> summaries; tables, JSON and plots
"""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
