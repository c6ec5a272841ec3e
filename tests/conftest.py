"""Shared fixtures: import paths, test checkpoints built once per session, reference generation."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]


def run(coro):
    """Run a coroutine to completion on a fresh event loop (no pytest-asyncio needed)."""
    return asyncio.run(coro)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A 2-layer random GPT-2 (initializer_range 0.15) with a trained BPE tokenizer; pad unset."""
    from make_test_model import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("tiny")), shape="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_pad_model_dir(tmp_path_factory) -> str:
    """Same shape, other weights, and a tokenizer whose pad id differs from EOS."""
    from make_test_model import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("tiny_pad")), shape="tiny", seed=1, with_pad=True)
