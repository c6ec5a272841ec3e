"""Command-line tools run from the checkout: ``python scripts/benchmark.py`` (or ``python -m scripts.benchmark``),
smoke.py, make_test_model.py, fetch_smollm2.py, build_llamacpp.py and the probes; ``bench/`` holds the
benchmark's parts."""
