"""Regression pin across the numpy rewrite of core/sampling.py: on fixed cases covering every feature (penalties,
logit_bias, greedy with ties, temperature, top-k with boundary ties, narrow and wide top-p (window escalation and
the full sort), min-p, combinations, -inf masked tokens, seeded rows at several steps among unseeded batchmates),
``sample`` gives exactly the tokens the torch implementation gave (commit 1fe1513, run on these same float32
logits through ``torch.from_numpy``). Greedy and seeded rows are pinned; unseeded rows cannot be (None).
"""

from __future__ import annotations

import numpy as np
import pytest

from core.sampling import SamplingParams as SP
from core.sampling import sample

STEPS = (0, 1, 2, 7, 30)


def _logits(seed, n, vocab, scale=3.0, quantum=None):
    """[n, vocab] float32 normal logits x scale from a fixed seed, rounded to multiples of ``quantum`` if given."""
    x = np.random.default_rng(seed).standard_normal((n, vocab)) * scale
    if quantum:  # many exact ties
        x = np.round(x / quantum) * quantum
    return x.astype(np.float32)


def cases():
    """(name, logits [N, V] float32, params, prompt_ids, output_ids) for each case and step."""
    out = []

    def add(name, logits, params, prompts=None, outputs=None):
        n = len(params)
        for step in STEPS:
            outs = [list(o) + [5] * step for o in outputs] if outputs is not None else [[5] * step] * n
            out.append((f"{name}@{step}", logits, params, prompts, outs))

    add("greedy", _logits(1, 4, 1000), [SP()] * 4)
    ties = _logits(2, 3, 64, quantum=2.0)
    add("greedy_ties", ties, [SP(), None, SP(temperature=1e-6)])
    add(
        "temperature",
        _logits(3, 6, 3000, 1.0),
        [SP(temperature=t, seed=s) for t, s in [(1.0, 0), (0.5, 1), (2.0, 2), (0.05, 3), (50.0, 4), (1.0, 2**63 - 1)]],
    )
    add(
        "top_k",
        _logits(4, 6, 2000, 2.0),
        [
            SP(temperature=t, top_k=k, seed=10 + k)
            for t, k in [(1.0, 1), (1.0, 5), (0.8, 40), (1.5, 300), (1.0, 1999), (1.0, 5000)]
        ],
    )
    add(
        "top_k_ties",
        _logits(5, 4, 500, 2.0, quantum=1.0),
        [SP(temperature=2.0, top_k=k, seed=k) for k in (1, 2, 3, 10)],
    )
    add(
        "top_p_narrow",
        _logits(6, 5, 4000, 3.0),
        [
            SP(temperature=t, top_p=p, seed=20 + i)
            for i, (t, p) in enumerate([(1.0, 0.1), (1.0, 0.3), (0.7, 0.5), (1.0, 0.9), (1.3, 0.95)])
        ],
    )
    add(
        "top_p_wide",
        _logits(7, 4, 6000, 0.05),  # nearly flat: nuclei of thousands of tokens (windows, then the full sort)
        [SP(temperature=1.0, top_p=p, seed=30 + i) for i, p in enumerate([0.05, 0.3, 0.9, 0.999])],
    )
    add(
        "top_p_ties",
        _logits(8, 3, 300, 2.0, quantum=0.5),
        [SP(temperature=1.0, top_p=p, seed=40 + i) for i, p in enumerate([0.2, 0.5, 0.8])],
    )
    add(
        "min_p",
        _logits(9, 4, 2500, 2.0),
        [
            SP(temperature=t, min_p=m, seed=50 + i)
            for i, (t, m) in enumerate([(1.0, 0.01), (1.0, 0.1), (2.0, 0.3), (1.0, 1.0)])
        ],
    )
    add(
        "combined",
        _logits(10, 5, 5000, 2.5),
        [
            SP(temperature=0.9, top_k=100, top_p=0.9, min_p=0.02, seed=60),
            SP(temperature=1.2, top_k=300, top_p=0.8, seed=61),
            SP(temperature=1.0, top_p=0.95, min_p=0.05, seed=62),
            SP(temperature=0.7, top_k=20, min_p=0.1, seed=63),
            SP(),
        ],
    )
    pen = _logits(11, 6, 1500, 2.0)
    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, 1500, int(rng.integers(1, 40))).tolist() for _ in range(6)]
    outputs = [rng.integers(0, 1500, int(rng.integers(0, 25))).tolist() for _ in range(6)]
    for i in range(6):  # make the penalties bite: the row's top tokens occurred
        top = np.argsort(-pen[i])[:5].tolist()
        prompts[i] += top[:2]
        outputs[i] += top[2:] * 2
    add(
        "penalties",
        pen,
        [
            SP(repetition_penalty=1.5),
            SP(frequency_penalty=1.5, presence_penalty=0.5),
            SP(temperature=1.0, repetition_penalty=0.7, seed=70),
            SP(
                temperature=0.8, top_k=50, repetition_penalty=1.3, presence_penalty=1.0, frequency_penalty=-0.5, seed=71
            ),
            SP(temperature=1.1, top_p=0.9, presence_penalty=-2.0, seed=72),
            SP(temperature=1.0, min_p=0.05, repetition_penalty=1e-38, seed=73),
        ],
        prompts,
        outputs,
    )
    bias = _logits(13, 5, 800, 2.0)
    top = bias.argmax(1).tolist()
    add(
        "logit_bias",
        bias,
        [
            SP(logit_bias=((top[0], -100.0),)),
            SP(logit_bias=((7, 100.0),)),
            SP(temperature=1.0, seed=80, logit_bias=((11, 5.0), (12, 5.0), (13, -3.0))),
            SP(temperature=1.0, top_k=10, seed=81, logit_bias=((top[3], -100.0), (0, 2.5))),
            SP(temperature=0.9, repetition_penalty=1.2, seed=82, logit_bias=((99, 3.0),)),
        ],
        [[1, 2, 3]] * 5,
        [[4, 5, top[4]]] * 5,
    )
    masked = _logits(14, 5, 3000, 2.0)
    allowed = np.random.default_rng(15).random((5, 3000)) < 0.01
    masked = np.where(allowed, masked, -np.inf).astype(np.float32)
    masked[4, :] = -np.inf
    masked[4, [17, 2999]] = [0.0, 0.0]  # two allowed tokens, tied
    add(
        "masked",
        masked,
        [
            SP(),
            SP(temperature=1.0, seed=90),
            SP(temperature=1.0, top_k=5, seed=91),
            SP(temperature=2.0, top_p=0.5, min_p=0.1, seed=92),
            SP(temperature=1.0, seed=93),
        ],
    )
    add(
        "batch_with_unseeded",
        _logits(16, 6, 2000, 1.5),
        [
            SP(temperature=1.0),
            SP(temperature=1.0, seed=100),
            SP(temperature=1.0, top_k=30),
            SP(temperature=1.0, top_k=30, seed=101),
            SP(temperature=1.0, top_p=0.7),
            SP(temperature=1.0, top_p=0.7, seed=102),
        ],
    )
    return out


# The torch implementation's tokens: case -> one list per step of STEPS, one token per row (None: unseeded).
EXPECTED = {
    "greedy": [
        [860, 408, 975, 284],
        [860, 408, 975, 284],
        [860, 408, 975, 284],
        [860, 408, 975, 284],
        [860, 408, 975, 284],
    ],
    "greedy_ties": [[56, 41, 8], [56, 41, 8], [56, 41, 8], [56, 41, 8], [56, 41, 8]],
    "temperature": [
        [1966, 1392, 1178, 2100, 1878, 1221],
        [102, 2970, 2613, 2100, 2175, 2464],
        [2541, 2536, 1756, 2100, 1452, 103],
        [1186, 1633, 310, 2100, 789, 1503],
        [1553, 653, 1735, 2100, 714, 1325],
    ],
    "top_k": [
        [1138, 620, 641, 936, 78, 184],
        [1138, 620, 1564, 516, 1628, 184],
        [1138, 1837, 556, 1488, 1552, 1308],
        [1138, 1583, 641, 1325, 1567, 1290],
        [1138, 828, 1030, 1017, 1192, 1302],
    ],
    "top_k_ties": [
        [220, 303, 294, 36],
        [220, 371, 361, 376],
        [220, 303, 68, 36],
        [220, 139, 361, 376],
        [220, 303, 68, 241],
    ],
    "top_p_narrow": [
        [1467, 2247, 1334, 1240, 1092],
        [1467, 77, 1334, 1458, 2079],
        [1467, 77, 2019, 2410, 776],
        [1467, 2718, 1334, 1104, 3324],
        [1467, 1592, 2019, 3196, 1806],
    ],
    "top_p_wide": [
        [5408, 3014, 2909, 2092],
        [758, 1223, 2700, 3895],
        [1456, 2677, 3552, 3431],
        [1456, 2258, 4534, 61],
        [4511, 5202, 5723, 1926],
    ],
    "top_p_ties": [[57, 22, 108], [163, 83, 245], [80, 110, 113], [80, 110, 54], [163, 159, 245]],
    "min_p": [
        [1053, 4, 618, 1773],
        [2054, 1791, 618, 1773],
        [612, 466, 55, 1773],
        [852, 466, 1808, 1773],
        [1678, 2021, 1154, 1773],
    ],
    "combined": [
        [4883, 3071, 3573, 1007, 739],
        [1760, 353, 4038, 209, 739],
        [3177, 577, 1417, 2289, 739],
        [3154, 406, 2440, 3848, 739],
        [3625, 1139, 2988, 1356, 739],
    ],
    "penalties": [
        [117, 1212, 574, 1462, 1386, 1314],
        [117, 1212, 1498, 771, 403, 664],
        [117, 1212, 498, 397, 943, 908],
        [117, 1212, 1187, 1089, 497, 1201],
        [117, 1212, 780, 5, 1386, 101],
    ],
    "logit_bias": [
        [594, 7, 91, 493, 663],
        [594, 7, 569, 651, 661],
        [594, 7, 558, 368, 25],
        [594, 7, 343, 679, 172],
        [594, 7, 181, 651, 671],
    ],
    "masked": [
        [292, 2388, 627, 2690, 2999],
        [292, 1209, 627, 1747, 2999],
        [292, 2388, 627, 1747, 2999],
        [292, 1209, 627, 1080, 2999],
        [292, 1390, 627, 1747, 17],
    ],
    "batch_with_unseeded": [
        [None, 1893, None, 549, None, 374],
        [None, 482, None, 954, None, 1246],
        [None, 1919, None, 1062, None, 405],
        [None, 181, None, 1989, None, 1343],
        [None, 1725, None, 336, None, 530],
    ],
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_tokens_equal_the_torch_implementations(case):
    runs = [(name, *rest) for name, *rest in cases() if name.split("@")[0] == case]
    assert len(runs) == len(STEPS)
    for (name, logits, params, prompts, outputs), want in zip(runs, EXPECTED[case]):
        logits.flags.writeable = False
        got = sample(logits, params, prompts, outputs, generator=np.random.default_rng(0))
        unseeded = [p is not None and not p.is_greedy and p.seed is None for p in params]
        assert [None if u else t for u, t in zip(unseeded, got)] == want, name
