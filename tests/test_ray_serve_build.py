"""The Ray Serve deployment (deploy/ray_serve.py) without a cluster: the plain server stack imports no ray, the
deployment options follow the config, a bad config fails the build naming the variable, and the health probe that
Serve asks."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import pytest

from config import Config, ConfigError
from engine import FakeEngine

from conftest import ROOT, run


def test_plain_server_stack_imports_no_ray():
    """The Ray deployment is an add-on: importing and building the server never imports ray."""
    script = (
        "import sys, config, engine, scheduler, server; server.create_app(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray'))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MODEL_ID": "fake"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_deployment_options_follow_the_config():
    from deploy.ray_serve import config_env, deployment_options, replica_config

    cfg = Config(model_id="fake", max_batch_size=8, max_queue_depth=100, drain_timeout_s=12)
    opts = deployment_options(cfg, {"num_replicas": 3})
    assert opts["num_replicas"] == 3 and "autoscaling_config" not in opts
    assert opts["max_ongoing_requests"] == 16  # one batch running, one waiting at the replica
    assert opts["max_queued_requests"] == 100
    assert opts["graceful_shutdown_timeout_s"] == 17.0
    auto = deployment_options(cfg, {"min_replicas": 1, "max_replicas": 4})["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["target_ongoing_requests"]) == (1, 4, 8)
    # MAX_CONCURRENT_REQUESTS below two batches caps what the router sends (else the replica would 429).
    capped = deployment_options(Config(model_id="fake", max_batch_size=8, max_concurrent_requests=5), {})
    assert capped["max_ongoing_requests"] == 5
    # NUM_THREADS: unset -> the CPUs Ray assigned the replica; set -> kept; no whole CPU -> 0 (all cores).
    assert replica_config({"MODEL_ID": "fake"}, 3.0).num_threads == 3
    assert replica_config({"MODEL_ID": "fake", "NUM_THREADS": "2"}, 3.0).num_threads == 2
    assert replica_config({"MODEL_ID": "fake"}, 0.5).num_threads == 0
    env = config_env({"MODEL_ID": "m", "MAX_BATCH_SIZE": "4", "MINIBATCH_CACHE": "/c", "HOME": "/root", "PATH": "/bin"})
    assert env == {"MODEL_ID": "m", "MAX_BATCH_SIZE": "4", "MINIBATCH_CACHE": "/c"}


def test_bad_config_fails_the_build_naming_the_variable():
    from deploy.ray_serve import build_app

    with pytest.raises(ConfigError, match="MAX_BATCH_SIZE"):
        build_app({"env": {"MODEL_ID": "fake", "MAX_BATCH_SIZE": "0"}})


def test_health_probe_fails_before_load_and_when_the_engine_loop_dies():
    """``check_health`` asks /health: Serve replaces a replica whose model never loaded or whose loop died."""
    from deploy.ray_serve import probe_health
    from server import create_app

    async def main():
        app = create_app(Config(model_id="fake"), engine=FakeEngine(capacity=2))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as local:
            with pytest.raises(RuntimeError, match="503"):
                await probe_health(local, "r1")  # lifespan not run: the model is not loaded
            async with app.router.lifespan_context(app):
                await probe_health(local, "r1")
                await app.state.server.scheduler.stop()  # the engine loop ends
                with pytest.raises(RuntimeError, match="dead"):
                    await probe_health(local, "r1")

    run(asyncio.wait_for(main(), 20))
