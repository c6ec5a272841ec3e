"""core/sampling_params.py: SamplingParams validation (each bad value names its field), its properties, and that
the server validates requests without torch."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import pytest

from core.sampling_params import SamplingParams

SP = SamplingParams


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", -1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", True),
        ("temperature", "1"),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.0001),
        ("top_p", math.nan),
        ("top_k", -1),
        ("top_k", 1.5),
        ("top_k", True),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("min_p", math.nan),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.nan),
        ("repetition_penalty", math.inf),
        ("presence_penalty", 2.01),
        ("presence_penalty", -2.01),
        ("presence_penalty", math.nan),
        ("frequency_penalty", 3),
        ("frequency_penalty", -2.5),
        ("frequency_penalty", math.inf),
        ("seed", -1),
        ("seed", 2**63),
        ("seed", 1.0),
        ("seed", True),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SP(**{field: value})


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0},
        {"temperature": 2.5, "top_p": 1.0, "top_k": 1, "min_p": 1.0},
        {"top_p": 1e-9, "min_p": 0.0, "top_k": 100000},
        {"repetition_penalty": 1e-3, "presence_penalty": -2, "frequency_penalty": 2},
        {"seed": 0},
        {"seed": 2**63 - 1},
    ],
)
def test_valid_edges_accepted(kwargs):
    SP(**kwargs).validate()


def test_properties_and_frozen():
    assert SP().is_greedy and not SP().has_penalties
    assert SP(temperature=0.0, repetition_penalty=1.3).is_greedy
    assert SP(repetition_penalty=1.3).has_penalties
    assert SP(presence_penalty=0.1).has_penalties and SP(frequency_penalty=-0.1).has_penalties
    assert not SP(temperature=0.7).is_greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        SP().temperature = 1.0  # frozen


def test_sampling_params_need_no_torch():
    """The server validates requests without torch: importing sampling must not pull it in."""
    script = (
        "import sys; from core import sampling; p = sampling.SamplingParams(temperature=0.7, seed=3); "
        "print(p.is_greedy, sampling.seeded_uniform(3, 0) < 1, 'torch' in sys.modules)"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True", "False"]
