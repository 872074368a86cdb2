"""meshlm evaluation: lm-evaluation-harness requests on a model + tokenizer + mesh, tasks, metrics, bias, toxicity.

Shape suffixes: B batch rows, L sequence length, V vocabulary. Log-likelihoods are natural-log sums (nats).
See docs/evaluation.md for the task formats and every metric's definition.
"""
from evals.requests import LM
from evals.tasks import TaskError, load_task, parse_specs
from evals.harness import evaluate

__all__ = ["LM", "TaskError", "evaluate", "load_task", "parse_specs"]
