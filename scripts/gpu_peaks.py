#!/usr/bin/env python
"""The roofline's two ceilings on a CUDA device, measured: memory bandwidth (a device-to-device copy, bytes read
plus written) and the bf16 / fp32 matrix-product rate. Writes one JSON object (``--json``) and prints it.

    python -m scripts.gpu_peaks --json $OUT/peaks.json     # scripts/gpu_check.sh runs it
    python -m scripts.gpu_peaks --device cpu --size 512     # the same code on the CPU (a dry run)
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def timed(fn, device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after 3 warm-ups, synchronized on ``device``."""
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure(device_name: str, copy_mib: int, size: int, repeats: int) -> dict:
    import torch

    device = torch.device(device_name)
    src = torch.empty(copy_mib * 2**20 // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), device, repeats)
    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device_name,
        "torch": torch.__version__,
        "copy_mib": copy_mib,
        "bandwidth_gb_s": 2 * src.numel() * 4 / copy_s / 1e9,  # read + write
    }
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(size, size, dtype=dtype, device=device)
        b = torch.randn(size, size, dtype=dtype, device=device)
        s = timed(lambda a=a, b=b: a @ b, device, repeats)
        out[f"matmul_{str(dtype).removeprefix('torch.')}_tflop_s"] = 2 * size**3 / s / 1e12
    out["matmul_size"] = size
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--copy-mib", type=int, default=2048, help="MiB copied per timed run")
    p.add_argument("--size", type=int, default=8192, help="square matrix side of the timed products")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json")
    args = p.parse_args(argv)
    result = measure(args.device, args.copy_mib, args.size, args.repeats)
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
