"""The Engine holds every sequence to the model's trained context (ringctx.model.context): ingest,
prefill, extend, generate / ask, ask_many (a batch's join) and chat past it are refused before any
command runs; allow_long_context runs them with one warning; rope_scaling stretches the limit, and
a document made without the stretch does not load with it. One process, the tiny preset (4,096
positions), float32."""

from __future__ import annotations

import warnings

import pytest

from ringctx import Engine
from ringctx.model.context import ContextTooLong, LongContextWarning

LIMIT = 4096
DOC = [(3 * i) % 250 + 3 for i in range(LIMIT - 100)]  # 3,996 tokens: 100 left


def ids(n: int) -> list[int]:
    return [(7 * i) % 250 + 3 for i in range(n)]


@pytest.fixture(scope="module")
def engine():
    with Engine("tiny", dtype="float32", prefix_cache_min_tokens=64) as engine:
        yield engine


@pytest.fixture(scope="module")
def document(engine):
    return engine.ingest(DOC)


@pytest.fixture
def no_commands(engine, monkeypatch):
    """Fail the test if any command is sent or run (the guard must come first)."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a command ran: {args[:2]}")

    monkeypatch.setattr(engine, "run_command", refuse)
    monkeypatch.setattr(engine, "send_command", refuse)


def test_the_limit_is_the_models_trained_context(engine):
    assert engine.context.limit == engine.model.config.trained_context == LIMIT


def test_ingest_and_prefill_past_the_limit_are_refused_before_any_command(engine, no_commands):
    for call in (lambda: engine.ingest(ids(LIMIT + 1)), lambda: engine.prefill(ids(LIMIT + 1)),
                 lambda: engine.start_prefill(ids(5000))):
        with pytest.raises(ContextTooLong, match=f"{LIMIT + 1:,} tokens|5,000 tokens") as caught:
            call()
        assert "trained context of tiny, 4,096 tokens" in str(caught.value)


def test_questions_count_the_document_and_max_new_tokens(engine, document, no_commands):
    with pytest.raises(ContextTooLong, match=r"3,996 cached \+ 3 new \+ 98 to generate"):
        engine.generate(document, [5, 6, 7], max_new_tokens=98)
    with pytest.raises(ContextTooLong, match="fewer new tokens"):
        engine.ask(document, [5, 6, 7])  # max_new_tokens 256 by default
    with pytest.raises(ContextTooLong):
        list(engine.ask_many(document, [[5, 6, 7], [8, 9]], max_new_tokens=200))  # each join is checked
    with pytest.raises(ContextTooLong, match=r"3,996 cached \+ 101 new"):
        engine.extend(document, ids(101))
    with pytest.raises(ContextTooLong):
        engine.start_extend(document, ids(101), chunk_tokens=64)


def test_a_conversation_past_the_limit_is_refused_before_its_prefill(engine, no_commands):
    with pytest.raises(ContextTooLong, match=r"4,000 new \+ 200 to generate"):
        engine.chat(ids(4000), max_new_tokens=200)


def test_within_the_limit_everything_runs(engine, document):
    answer = engine.generate(document, [5, 6, 7], max_new_tokens=97, stop_token_ids=[])
    "".join(answer)
    assert len(answer.result.token_ids) == 97  # exactly to the limit
    first = engine.chat(ids(300), max_new_tokens=4)
    turn = ids(300) + first.token_ids + ids(3800)  # the next turn of the conversation passes the limit
    with pytest.raises(ContextTooLong, match="to generate"):
        engine.chat(turn, max_new_tokens=4)


def test_allow_long_context_runs_with_one_warning():
    with Engine("tiny", dtype="float32", allow_long_context=True) as engine:
        with pytest.warns(LongContextWarning, match="5,000 tokens .*trained context of tiny, 4,096") as caught:
            document = engine.ingest(ids(5000))
        assert len(caught) == 1 and document.length == 5000
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once per engine
            answer = engine.generate(document, [5, 6], max_new_tokens=2)
            list(answer)
            assert answer.result is not None


def test_rope_scaling_stretches_the_limit_and_keeps_documents_apart(tmp_path, engine):
    saved = tmp_path / "plain.kv"
    engine.save_document(engine.ingest(ids(200)), str(saved))
    with Engine("tiny", dtype="float32", rope_scaling="yarn:2") as stretched:
        assert stretched.context.limit == stretched.model.config.trained_context == 2 * LIMIT
        assert stretched.model.config.rope_scaling.rope_type == "yarn"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert stretched.ingest(ids(5000)).length == 5000
        with pytest.raises(ValueError, match="fingerprint"):
            stretched.load_document(str(saved))  # made without the stretch


def test_bad_rope_scaling_is_refused_before_start():
    for spec, says in (("yarn:0", "above 1"), ("foo:2", "unknown type"), ("yarn:", "needs a factor")):
        with pytest.raises(ValueError, match=says):
            Engine("tiny", rope_scaling=spec)
    with pytest.raises(ValueError, match="already scales its RoPE"):
        Engine("llama3.2-1b", rope_scaling="yarn:2")  # refused before its weights are made


def test_every_rank_loads_the_stretch():
    """Spawned ranks load the same stretched model (their start-up agreement compares fingerprints)
    and a prefill past the plain limit runs over both without a warning."""
    with Engine("tiny", nproc=2, dtype="float32", rope_scaling="linear:2", chunk_tokens=1024) as engine:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            document = engine.ingest(ids(5000))
        assert document.length == 5000 and engine.context.limit == 2 * LIMIT
        assert engine.state.model.config.rope_scaling.rope_type == "linear"
