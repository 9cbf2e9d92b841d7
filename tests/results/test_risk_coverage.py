"""Risk–coverage: a detector's score as a reject rule for the classifier, against brute-force computations."""

import numpy as np
import pytest
from helpers import synthetic_scores

from oodviz.figures.plots import ORACLE_COLOR, risk_coverage_figure
from oodviz.results.analysis import ORACLE, risk_coverage_curves
from oodviz.results.metrics import aurc, risk_at_coverage, risk_coverage
from oodviz.results.tables import ID_SPLIT, metrics_table, selective_metrics


def brute_force_curve(scores, errors):
    """Every distinct threshold t, lowest first: (t, share accepted by score <= t, error rate among them)."""
    scores, errors = np.asarray(scores, np.float64), np.asarray(errors, bool)
    points = []
    for t in sorted(set(scores.tolist())):
        accepted = scores <= t
        points.append((t, accepted.mean(), errors[accepted].mean()))
    return np.array(points)


def random_case(n, seed, ties):
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=n)
    errors = rng.random(n) < 0.1 + 0.3 * (scores > 0.5)  # more errors among the OOD-looking: a useful rule
    return (np.round(scores, 1) if ties else scores), errors


@pytest.mark.parametrize(("n", "seed", "ties"), [(1, 0, False), (37, 1, False), (500, 2, False), (500, 3, True)])
def test_the_curve_is_the_brute_force_one_at_every_distinct_threshold(n, seed, ties):
    scores, errors = random_case(n, seed, ties)
    curve = risk_coverage(scores, errors)
    expected = brute_force_curve(scores, errors)
    np.testing.assert_array_equal(curve["thresholds"], expected[:, 0])
    np.testing.assert_allclose(curve["coverage"], expected[:, 1], rtol=0, atol=1e-15)
    np.testing.assert_allclose(curve["risk"], expected[:, 2], rtol=0, atol=1e-15)
    assert curve["coverage"][-1] == 1 and curve["risk"][-1] == pytest.approx(errors.mean(), abs=1e-15)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_aurc_without_ties_is_the_mean_risk_of_the_k_most_confident(seed):
    """Geifman et al.: AURC = 1/n sum_k (errors among the k lowest scores) / k."""
    scores, errors = random_case(300, seed, ties=False)
    order = np.argsort(scores)
    expected = np.mean([errors[order[:k]].sum() / k for k in range(1, len(scores) + 1)])
    assert aurc(risk_coverage(scores, errors)) == pytest.approx(expected, abs=1e-14)


def test_aurc_with_ties_gives_a_tie_group_its_risk_over_its_coverage():
    scores, errors = random_case(400, 5, ties=True)
    points = brute_force_curve(scores, errors)
    expected, covered = 0.0, 0.0
    for _, coverage, risk in points:
        expected += risk * (coverage - covered)
        covered = coverage
    assert aurc(risk_coverage(scores, errors)) == pytest.approx(expected, abs=1e-14)
    # Ties are accepted together: the curve does not depend on the order of tied samples.
    flipped = np.arange(len(scores))[::-1]
    assert aurc(risk_coverage(scores[flipped], errors[flipped])) == aurc(risk_coverage(scores, errors))


@pytest.mark.parametrize(("ties", "coverage"), [(False, 0.95), (True, 0.95), (True, 0.5), (False, 1.0)])
def test_risk_at_coverage_is_the_risk_at_the_lowest_threshold_that_covers_it(ties, coverage):
    scores, errors = random_case(200, 7, ties)
    t = min(t for t in scores if np.mean(scores <= t) >= coverage)
    expected = errors[scores <= t].mean()
    assert risk_at_coverage(risk_coverage(scores, errors), coverage) == pytest.approx(expected, abs=1e-15)
    # 19 of 20 accepted is 95% coverage exactly (no float rounding past it)
    assert risk_at_coverage(risk_coverage(np.arange(20.0), np.arange(20) >= 18)) == pytest.approx(1 / 19)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="3 scores but 2 error flags"):
        risk_coverage([1, 2, 3], [True, False])
    with pytest.raises(ValueError, match="NaN or infinite"):
        risk_coverage([1, np.nan], [True, False])
    with pytest.raises(ValueError, match=r"coverage must be in \(0, 1\]"):
        risk_at_coverage(risk_coverage([1.0], [True]), 0)


def test_metrics_table_has_aurc_and_risk_at_95_coverage_per_detector():
    scores = synthetic_scores()
    table = metrics_table(scores, {"far-set": "far", "near-set": "near"})
    id_rows = scores[scores.split == ID_SPLIT]
    errors = (id_rows.prediction != id_rows.label).to_numpy()
    for detector in ("det", "tied"):
        values = id_rows[detector].to_numpy(np.float64)
        order = np.argsort(values, kind="stable")
        rows = table[table.detector == detector]
        assert rows.aurc.nunique() == 1 and rows.risk_at_95_coverage.nunique() == 1
        assert rows.aurc.iloc[0] == selective_metrics(scores, detector)["aurc"]
        t = min(t for t in values if np.mean(values <= t) >= 0.95)
        assert rows.risk_at_95_coverage.iloc[0] == pytest.approx(errors[values <= t].mean(), abs=1e-15)
        if detector == "det":  # continuous scores: no ties
            expected = np.mean([errors[order[:k]].sum() / k for k in range(1, len(values) + 1)])
            assert rows.aurc.iloc[0] == pytest.approx(expected, abs=1e-14)


def test_curves_for_the_browser_are_thinned_exact_points_with_the_oracle_last():
    scores = synthetic_scores()
    curves = risk_coverage_curves(scores, max_points=50)
    assert list(curves) == ["det", "tied", ORACLE]
    full = risk_coverage(scores.loc[scores.split == ID_SPLIT, "det"], (scores.prediction != scores.label)[:200])
    shown = curves["det"]
    assert 2 < len(shown["coverage"]) <= 50 and shown["coverage"][0] == full["coverage"][0]
    assert shown["coverage"][-1] == 1.0
    kept = np.searchsorted(full["coverage"], shown["coverage"])
    np.testing.assert_array_equal(full["risk"][kept], shown["risk"])
    assert shown["aurc"] == aurc(full)
    # The oracle rejects the errors first: zero risk up to the accuracy, never above any detector's AURC
    id_rows = scores[scores.split == ID_SPLIT]
    accuracy = (id_rows.label == id_rows.prediction).mean()
    oracle = curves[ORACLE]
    assert np.all(oracle["risk"][oracle["coverage"] <= accuracy] == 0)
    assert oracle["aurc"] < min(curves["det"]["aurc"], curves["tied"]["aurc"])
    n, errors = len(id_rows), int((id_rows.label != id_rows.prediction).sum())
    assert oracle["aurc"] == pytest.approx(sum(max(0, k - (n - errors)) / k for k in range(1, n + 1)) / n, abs=1e-14)


def test_the_figure_draws_every_curve_named_with_its_aurc():
    curves = risk_coverage_curves(synthetic_scores())
    fig = risk_coverage_figure(curves)
    assert [t.name.split(" (AURC")[0] for t in fig.data] == list(curves)
    for trace, curve in zip(fig.data, curves.values(), strict=True):
        np.testing.assert_array_equal(trace.x, curve["coverage"])
        np.testing.assert_array_equal(trace.y, curve["risk"])
        assert f"{curve['aurc']:.4g}" in trace.name
    assert fig.data[-1].line.dash == "dash"
    assert fig.layout.shapes[0].x0 == 0.95
    many = {f"d{i}": curves["det"] for i in range(20)} | {ORACLE: curves[ORACLE]}  # 20 detectors: 20 own colours
    styles = [(t.line.color, t.line.dash) for t in risk_coverage_figure(many).data[:-1]]
    assert len(set(styles)) == 20 and (ORACLE_COLOR, "dash") not in styles


def test_a_real_runs_metrics_have_the_selective_columns(default_results):
    metrics = default_results.metrics
    for detector, rows in metrics.groupby("detector"):
        assert rows.aurc.nunique() == 1
        assert rows.aurc.iloc[0] == pytest.approx(selective_metrics(default_results.scores, detector)["aurc"])
        assert 0 <= rows.risk_at_95_coverage.iloc[0] <= 1
