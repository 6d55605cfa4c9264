"""Code-benchmark evaluation (imported as ``mtp.eval``): HumanEval(+), MBPP(+), pass@k.

Entry points: :func:`pass_at_k`; :func:`evaluate_completions` (score or generate + score);
``mtp eval`` (:func:`mtp.eval.cli.main`). Never imports Lightning.
"""

from mtp.eval.data import load_benchmark
from mtp.eval.harness import Completer, evaluate_completions
from mtp.eval.passk import pass_at_k

__all__ = ["Completer", "evaluate_completions", "load_benchmark", "pass_at_k"]
