"""lm-evaluation-harness (``lm_eval``, pinned in the test extra) scores a small multiple-choice task
(``tests/data/tiny_mc.yaml`` and its JSONL: no hub) through splitserve — its ``local-completions``
model, which asks for each choice's loglikelihood with ``echo``, ``logprobs`` and ``max_tokens``
1 — and through its own Hugging Face backend on the same checkpoint, float32: the accuracies
agree, and every item's loglikelihoods agree within ``LL_TOL``.

lm-eval runs with batch size 1 (one prompt per request; ``/v1/completions`` takes a batch of one),
offline (``HF_*_OFFLINE``), with the checkpoint's own tokenizer folder. Two tests:

- everyday: four items (``FEW_DOCS``) against the session's shared colocated ``server`` (the
  checkpoint is float, so its default ``--quantization auto`` loads it unquantized, as ``none``
  would);
- ``long``: every item, against a worker of its own started with ``--quantization none`` and
  through the router of the session's split cluster (it sends these requests to decode alone): a
  server start of its own and two placements of every item, which on a busy shared machine run
  past the everyday suite's budget."""

from __future__ import annotations

import functools
from typing import Optional

import pytest
import requests

from conftest import REPO, ServerProcess

lm_eval = pytest.importorskip("lm_eval")

LL_TOL = 1e-3  # |splitserve - transformers| per choice's loglikelihood (a sum of a few float32 logprobs)
ALL_DOCS = 12  # the lines of tests/data/tiny_mc.jsonl
# the everyday test's items (lm-eval's `samples`): four, one of them the tiny model's one right
# answer (doc 7), so the accuracies it compares are not both zero
FEW_DOCS = (4, 5, 6, 7)


@pytest.fixture(scope="module", params=["colocated", "split"])
def served(request):
    """(the URL lm-eval is pointed at, a worker's URL): a colocated worker, or the router of the
    session's split cluster, which sends lm-eval's prompt-logprob requests to decode alone."""
    if request.param == "split":
        cluster = request.getfixturevalue("pd_cluster")
        yield cluster.url, cluster.decode[0].url
        return
    proc = ServerProcess("--quantization", "none").start()
    try:
        yield proc.url, proc.url
    finally:
        proc.stop()


@functools.lru_cache(maxsize=2)
def _transformers_run(path: str, docs: Optional[tuple[int, ...]]) -> dict:
    """lm-eval's own Hugging Face backend on the checkpoint (once per set of items for every placement)."""
    return _evaluate("hf", f"pretrained={path},dtype=float32,device=cpu", docs)


def _evaluate(model: str, model_args: str, docs: Optional[tuple[int, ...]]) -> dict:
    """lm-eval's results on the items ``docs`` of the task (None: all of them)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(REPO / "tests" / "data"), include_defaults=False)
    return simple_evaluate(model=model, model_args=model_args, tasks=["splitserve_tiny_mc"], batch_size=1,
                           task_manager=tasks, log_samples=True, samples=None if docs is None else
                           {"splitserve_tiny_mc": list(docs)}, random_seed=0, numpy_random_seed=0,
                           torch_random_seed=0, fewshot_random_seed=0)


def _per_item(results: dict) -> list[tuple[int, list[float], float]]:
    samples = sorted(results["samples"]["splitserve_tiny_mc"], key=lambda s: s["doc_id"])
    return [(s["doc_id"], [r[0][0] for r in s["resps"]], s["acc"]) for s in samples]


def assert_scores_alike(url: str, worker: str, monkeypatch, docs: Optional[tuple[int, ...]] = None) -> None:
    """lm-eval on the items ``docs`` (None: all) through ``url`` (``worker``: one of its
    workers, which names the checkpoint) and through transformers: each item's loglikelihoods
    (within ``LL_TOL``) and accuracy agree, and so does the task's accuracy."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.chdir(REPO)  # the task's data_files are relative to the repository
    path = requests.get(worker + "/get_model_info", timeout=10).json()["model_path"]
    ours = _evaluate("local-completions", f"model=tiny,base_url={url}/v1/completions,tokenizer={path},"
                                          "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1", docs)
    theirs = _transformers_run(path, docs)
    a, b = _per_item(ours), _per_item(theirs)
    assert [doc for doc, _, _ in a] == [doc for doc, _, _ in b] == list(docs or range(ALL_DOCS))
    worst = 0.0
    for (doc, ll_ours, acc_ours), (_, ll_theirs, acc_theirs) in zip(a, b):
        assert ll_ours == pytest.approx(ll_theirs, abs=LL_TOL), doc
        assert acc_ours == acc_theirs, doc
        worst = max(worst, *(abs(x - y) for x, y in zip(ll_ours, ll_theirs)))
    acc = ours["results"]["splitserve_tiny_mc"]["acc,none"]
    assert acc == theirs["results"]["splitserve_tiny_mc"]["acc,none"]
    print(f"\nlm-eval splitserve_tiny_mc, {len(a)} items: acc {acc:.3f} on both; worst |dloglikelihood| {worst:.2e}")


def test_lm_eval_scores_a_few_items_alike_through_splitserve_and_transformers(server, monkeypatch):
    assert_scores_alike(server.url, server.url, monkeypatch, FEW_DOCS)


@pytest.mark.long
def test_lm_eval_scores_alike_through_splitserve_and_transformers(served, monkeypatch):
    url, worker = served
    assert_scores_alike(url, worker, monkeypatch)
