"""What the experiments of Chuppala (2024) conclude from their rows: the checks they print."""

from __future__ import annotations

from experiments.stable import targets

MODELS = ["opt-125m", "opt-1.3b", "opt-6.7b"]


def _rows(rewards: dict[str, dict[float, float]]) -> list[dict[str, object]]:
    return [
        {"policy": policy, "rate": rate, "seed": seed, "mean_reward": value}
        for policy, by_rate in rewards.items()
        for rate, value in by_rate.items()
        for seed in range(2)
    ]


def test_light_load_is_judged_only_where_the_biggest_model_alone_meets_its_slo() -> None:
    rows = _rows({
        "dqn": {1.0: 0.99, 24.0: 0.84},
        "opt-125m-only": {1.0: 0.68, 24.0: 0.69},
        "opt-1.3b-only": {1.0: 0.90, 24.0: 0.04},
        "opt-6.7b-only": {1.0: 1.00, 24.0: 0.0},
    })  # fmt: skip
    lines = targets(rows, MODELS, [1.0, 24.0])
    assert any("light load (1 req/s): DQN 0.990 against opt-6.7b alone 1.000, 99.0%" in line
               for line in lines), lines  # fmt: skip
    busy = targets([r for r in rows if r["rate"] == 24.0], MODELS, [24.0])
    assert any("light load not in this sweep" in line for line in busy), busy
    assert not any("of it" in line for line in busy), "no ratio to a model that served nothing"


def test_figure_4_holds_the_dqn_to_the_best_of_the_others_at_every_rate() -> None:
    rows = _rows({
        "dqn": {8.0: 0.950, 48.0: 0.760},
        "dqn-previous": {8.0: 0.953, 48.0: 0.733},
        "threshold": {8.0: 0.926, 48.0: 0.770},
        "opt-125m-only": {8.0: 0.68, 48.0: 0.69},
        "opt-1.3b-only": {8.0: 0.906, 48.0: 0.0},
        "opt-6.7b-only": {8.0: 0.1, 48.0: 0.0},
    })  # fmt: skip
    lines = targets(rows, MODELS, [8.0, 48.0])
    verdict = next(i for i, line in enumerate(lines) if line.startswith("DQN >= max("))
    # 0.003 below the previous DQN at 8 req/s is within 0.005; 0.010 below threshold at 48 not.
    assert lines[verdict].endswith("missed at 48 req/s"), lines
    assert lines[verdict - 1].endswith("!") and not lines[verdict - 2].endswith("!"), lines
