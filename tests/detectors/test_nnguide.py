"""oodviz.detectors.nnguide: parity with pytorch-ood 0.4 on the same inputs, float64 reference formulas written independently here,
its bank on disk, and bad input."""

import numpy as np
import pytest
import torch
from detector_checks import fitted_scores
from helpers import assert_same_ranking
from pytorch_ood import detector as pood
from scipy.special import logsumexp

from oodviz.detectors import create


def _nnguide_reference(problem, k):
    fx, ex = problem.fit_x.double().numpy(), problem.eval_x.double().numpy()
    w, b = problem.weight.double().numpy(), problem.bias.double().numpy()
    confidence = lambda x: logsumexp(x @ w.T + b, axis=1)  # noqa: E731
    bank = fx / np.linalg.norm(fx, axis=1, keepdims=True) * confidence(fx)[:, None]
    similarities = (ex / np.linalg.norm(ex, axis=1, keepdims=True)) @ bank.T
    guidance = -np.sort(-similarities, axis=1)[:, :k].mean(1)
    return -guidance * confidence(ex)


@pytest.mark.parametrize("k", [1, 10, 37])
def test_nnguide_matches_pytorch_ood_and_the_float64_formula(problem, k):
    det, ours = fitted_scores(problem, "nnguide", k=k)
    with torch.no_grad():
        theirs = pood.NNGuide(None, problem.logits, k=k).fit_features(problem.fit_x, problem.fit_y)
        theirs = theirs.predict_features(problem.eval_x).double().numpy()
    assert_same_ranking(ours, theirs, n_id=len(problem.test_x))
    expected = _nnguide_reference(problem, k)
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


def test_nnguide_keeps_its_scaled_bank_on_disk_and_searches_it_in_chunks(problem, tmp_path):
    det = create("nnguide", k=10, chunk_size=7, bank_dir=str(tmp_path)).fit(problem.fit_batches(), head=problem.head)
    assert isinstance(det.bank_, np.memmap) and det.bank_path_.startswith(str(tmp_path))
    fx = problem.fit_x.double().numpy()
    confidence = logsumexp(fx @ problem.weight.double().numpy().T + problem.bias.double().numpy(), axis=1)
    np.testing.assert_allclose(
        det.bank_, fx / np.linalg.norm(fx, axis=1, keepdims=True) * confidence[:, None], rtol=1e-5
    )
    scores = det.score(b for b in problem.batches(problem.eval_x))  # 172 chunks, a one-shot iterable
    expected = _nnguide_reference(problem, 10)
    np.testing.assert_allclose(scores.numpy(), expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


def test_nnguide_faiss_flat_backend_gives_the_exact_scores(problem):
    pytest.importorskip("faiss")
    det = create("nnguide", k=10, backend="faiss-flat").fit(problem.fit_batches(), head=problem.head)
    expected = _nnguide_reference(problem, 10)
    np.testing.assert_allclose(det.score(problem.batches(problem.eval_x)).numpy(), expected, rtol=1e-4, atol=1e-4)


def test_nnguide_needs_the_head_and_k_rows(problem):
    with pytest.raises(ValueError, match=r"needs the classifier's final linear layer"):
        create("nnguide").fit(problem.fit_batches())
    with pytest.raises(ValueError, match=r"nnguide: k=50 exceeds the 40 in-distribution samples"):
        create("nnguide", k=50).fit(problem.batches(problem.fit_x[:40], problem.fit_y[:40]), head=problem.head)
