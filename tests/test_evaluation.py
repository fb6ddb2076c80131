import numpy as np
from sklearn.metrics import average_precision_score

from streamxm.learning.evaluation import average_precision, label_relevance, mean_average_precision


def test_ap_matches_sklearn_per_query_on_random_scores() -> None:
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(40, 300))  # continuous: no ties
    labels_q, labels_g = rng.integers(0, 5, 40), rng.integers(0, 5, 300)
    rel = label_relevance(labels_q, labels_g)
    ours = average_precision(scores, rel)
    for i in range(40):
        assert abs(ours[i] - average_precision_score(rel[i], scores[i])) < 1e-12
    assert abs(mean_average_precision(scores, rel) - ours.mean()) < 1e-15


def test_ties_are_broken_by_gallery_order() -> None:
    scores = np.zeros((1, 4))
    assert average_precision(scores, np.array([[True, False, False, False]]))[0] == 1.0
    assert average_precision(scores, np.array([[False, False, False, True]]))[0] == 0.25


def test_query_without_relevant_items_is_left_out() -> None:
    scores = np.array([[0.3, 0.2], [0.1, 0.9]])
    rel = np.array([[False, False], [False, True]])
    assert np.isnan(average_precision(scores, rel)[0])
    assert mean_average_precision(scores, rel) == 1.0


def test_multilabel_relevance_means_sharing_a_label() -> None:
    q = np.array([[1, 0, 1], [0, 1, 0]])
    g = np.array([[0, 0, 1], [1, 1, 0], [0, 0, 0]])
    assert label_relevance(q, g).tolist() == [[True, True, False], [False, True, False]]
