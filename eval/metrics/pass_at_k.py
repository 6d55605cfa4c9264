"""pass@k as a Hugging Face ``evaluate`` metric, loaded from a local path (no hub access).

    import evaluate
    from mtp.eval.passk import METRIC_PATH
    metric = evaluate.load(str(METRIC_PATH))
    metric.compute(num_samples=[10, 10], num_correct=[3, 0], k=[1, 5])

It calls :func:`mtp.eval.passk.pass_at_k_table`, so its numbers are the harness's numbers.
"""

import datasets
import evaluate
from mtp.eval.passk import pass_at_k_table

_DESCRIPTION = """Unbiased pass@k (Chen et al. 2021): mean over tasks of 1 - C(n-c, k) / C(n, k),
reported for each k no larger than the smallest n."""

_KWARGS_DESCRIPTION = """
Args:
    num_samples: samples generated per task (n).
    num_correct: samples that passed per task (c).
    k: list of k values (default [1, 10, 100]).
Returns:
    {"pass@k": float in [0, 1]} for each k <= min(num_samples).
"""

_CITATION = """@article{chen2021codex, title={Evaluating Large Language Models Trained on Code},
author={Chen, Mark and others}, journal={arXiv:2107.03374}, year={2021}}"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class PassAtK(evaluate.Metric):
    """pass@k from per-task sample and pass counts."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"num_samples": datasets.Value("int64"), "num_correct": datasets.Value("int64")}
            ),
        )

    def _compute(self, num_samples, num_correct, k=(1, 10, 100)):
        return pass_at_k_table(list(num_samples), list(num_correct), k)
