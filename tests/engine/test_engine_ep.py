"""Expert parallelism in the engine (--ep, ringctx.model.expert_parallel) on tests/model/test_model_moe.py's
tiny Qwen3-MoE (6 experts, a dense layer between sparse ones) and Mixtral (4 experts, every layer
sparse): at world 2 with ep 2 every rank holds half of each layer's experts, and
    prefills (pass-KV and pass-Q forced; a 1-token chunk leaves a rank without tokens: it still takes
    part in the all-to-alls) give last logits within 1e-5 relative of ep 1's, and of transformers' 1e-4;
    answers on a document split over both decode ranks, alone and batched (ask_many), are ep 1's
    greedy tokens and transformers';
    with TP 2 as well (world 4: each expert's width over TP, the experts over EP) likewise;
and bad --ep values are one line before any rank starts."""

import pytest
import torch

from ringctx.engine import Engine
from tests.helpers import SavedHFModels, hf_greedy, hf_logits, random_prompt, rel_err
from tests.model.test_model_moe import random_hf_model

PREFILLS = ((1, 8), (5, 64), (97, 37), (2049, 2049))
"""(prompt tokens, chunk tokens): one token on two ranks, a short prompt, several uneven chunks, and
1,025 / 1,024 rows on the two ranks, which the block would cut into 2 and 1 row slices without EP
(past the tiny models' 512 trained positions: allow_long_context)."""
DOC, QUESTIONS = random_prompt(130, seed=3).tolist(), [[7, 11, 13], [5, 9], [21, 22, 23, 24, 25, 26, 27, 28, 29]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return SavedHFModels(random_hf_model, tmp_path_factory)


def run_engine(directory: str, **settings) -> dict:
    """What one engine computes: every prefill's last logits (both strategies), the EP bytes of the
    last one, the first sparse layer's expert count on rank 0, and the document's greedy answers
    (the first question alone, then all of them batched)."""
    out = {"logits": {}, "answers": []}
    with Engine(directory, dtype="float32", chunk_tokens=32, allow_long_context=True, **settings) as engine:
        for n, chunk in PREFILLS:
            for strategy in ("pass-kv", "pass-q"):
                result = engine.prefill(random_prompt(n), chunk_tokens=chunk, strategy=strategy)
                out["logits"][n, strategy] = result.logits.clone()
        out["ep_bytes"] = result.stats.ep_bytes_per_rank
        out["held"] = next(b.feed_forward.w13.shape[0] for b in engine.model.layers if hasattr(b.feed_forward, "router"))
        doc = engine.ingest(DOC)
        alone = engine.generate(doc, QUESTIONS[0], max_new_tokens=8, stop_token_ids=[])
        "".join(alone)
        out["answers"].append(alone.result.token_ids)
        many = engine.ask_many(doc, QUESTIONS, max_new_tokens=8, stop_token_ids=[])
        for _ in many:
            pass
        out["answers"] += [r.token_ids for r in many.results]
    return out


def assert_ep_equals_ep1(ep: dict, one: dict, hf, n_experts: int, ep_size: int) -> None:
    assert ep["held"] == n_experts // ep_size and one["held"] == n_experts
    for (n, strategy), logits in ep["logits"].items():
        assert rel_err(logits, one["logits"][n, strategy]) < 1e-5, (n, strategy)
        assert rel_err(logits, hf_logits(hf, random_prompt(n))[-1:]) < 1e-4, (n, strategy)
    assert all(b > 0 for b in ep["ep_bytes"]) and not any(one["ep_bytes"])
    assert ep["answers"] == one["answers"]
    assert ep["answers"][0] == hf_greedy(hf, DOC + QUESTIONS[0])
    assert ep["answers"][1:] == [hf_greedy(hf, DOC + q) for q in QUESTIONS]


@pytest.mark.parametrize("case,n_experts", [("qwen3-moe-norm", 6), ("mixtral", 4)])
def test_ep2_prefills_and_answers_equal_ep1(saved, case, n_experts):
    directory, hf = saved[case]
    one = run_engine(directory, nproc=2, decode_ranks=2)
    ep = run_engine(directory, nproc=2, decode_ranks=2, ep=2)
    assert_ep_equals_ep1(ep, one, hf, n_experts, 2)


FAMILIES = {"gpt-oss": "tests.model.test_model_gptoss", "llama4-moe": "tests.model.test_model_llama4_moe",
            "gemma4-moe": "tests.model.test_model_gemma4_moe"}
"""The other routers under EP: gpt-oss's biased top-k softmax with biased clamped-SwiGLU experts (the
down bias added by one rank), Llama 4's sigmoid router scaling the inputs plus a shared expert,
Gemma 4's scaled router with experts beside a dense MLP."""


@pytest.mark.parametrize("case", list(FAMILIES))
def test_ep2_on_the_other_families_equals_transformers(case, tmp_path_factory):
    import importlib

    make = importlib.import_module(FAMILIES[case]).random_hf_model
    directory, hf = SavedHFModels(make, tmp_path_factory)[case]
    ep = run_engine(directory, nproc=2, decode_ranks=2, ep=2)
    config = getattr(hf.config, "text_config", hf.config)
    assert ep["held"] == (getattr(config, "num_local_experts", None) or config.num_experts) // 2
    for (n, strategy), logits in ep["logits"].items():
        assert rel_err(logits, hf_logits(hf, random_prompt(n))[-1:]) < 1e-4, (case, n, strategy)
    assert all(b > 0 for b in ep["ep_bytes"])
    assert ep["answers"][0] == hf_greedy(hf, DOC + QUESTIONS[0])
    assert ep["answers"][1:] == [hf_greedy(hf, DOC + q) for q in QUESTIONS]


def test_ep2_with_tp2_equals_ep1(saved):
    """World 4 = CP 2 x TP 2: the EP groups are {0, 2} and {1, 3} (each TP index's CP ranks)."""
    directory, hf = saved["qwen3-moe-norm"]
    one = run_engine(directory, nproc=4, tp=2, decode_ranks=2)
    ep = run_engine(directory, nproc=4, tp=2, decode_ranks=2, ep=2)
    assert_ep_equals_ep1(ep, one, hf, 6, 2)


def test_bad_ep_is_one_line_before_any_rank_starts(saved):
    directory, _ = saved["mixtral"]
    cases = [(dict(model="smollm2-135m", nproc=2, decode_ranks=2, ep=2), "dense model"),
             (dict(model=directory, nproc=2, decode_ranks=2, ep=3), "does not divide the 4 experts"),
             (dict(model=directory, nproc=1, ep=2), "does not divide the 1 CP ranks"),
             (dict(model=directory, nproc=2, decode_ranks=1, ep=2), "whole EP groups"),
             (dict(model=directory, nproc=2, ep=0), "ep must be a positive integer")]
    for settings, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            Engine(**settings)
        assert "\n" not in str(info.value)
