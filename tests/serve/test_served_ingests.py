"""A document ingested by `ringctx serve`'s backend (EngineBackend, in this process, nproc=1) is the
same whatever runs beside it: ingested while answers decode (the scheduler runs its chunk in slices
of whole layers between their tokens) its KV rows, its last logits and a greedy answer about it
equal those of the same text ingested with nothing else running, in the engine's own chunk size.

A tiny random Qwen3-MoE with the word-level tokenizer of test_served_families (no hub reached);
the prefix cache is off, so that the answers about the two documents are each computed from their
own rows.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from tests.helpers import SavedHFModels

from .test_served_families import DOCUMENT, QUESTIONS, random_hf_model, save_word_tokenizer

pytest.importorskip("fastapi")
from ringctx.serve import backend as api  # noqa: E402
from ringctx.serve.service import EngineBackend  # noqa: E402

CHUNK = 16
"""The engine's chunk (--chunk-tokens): a document of ~170 tokens ingests in ~11 chunks."""
OTHER = " ".join(["the old town is quiet and the dog sleeps"] * 4)


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    directory, hf = SavedHFModels(random_hf_model, tmp_path_factory)["qwen3-moe-norm"]
    save_word_tokenizer(directory, hf.config.vocab_size)
    served = EngineBackend(store_dir=str(tmp_path_factory.mktemp("store")), model=directory, nproc=1,
                           dtype="float32", chunk_tokens=CHUNK, prefix_cache=False)
    yield served
    served.close()


def wait_ready(backend, doc_id: str) -> api.DocumentInfo:
    deadline = time.monotonic() + 120
    while (info := backend.document(doc_id)).status == "ingesting":
        assert time.monotonic() < deadline, f"{doc_id} still ingesting"
        time.sleep(0.02)
    assert info.status == "ready", info
    return info


def ask(backend, doc_id: str, question: str, max_tokens: int):
    """Submit a greedy question about the document (its answer is read with `answer_text`)."""
    return backend.generate(api.GenerateRequest(messages=({"role": "user", "content": " " + question},),
                                                document=doc_id, sampling=api.Sampling(max_tokens=max_tokens,
                                                                                       temperature=0.0)))


def answer_text(answer) -> str:
    async def read():
        return "".join([e.text async for e in answer if isinstance(e, api.Piece)])
    return asyncio.run(read())


def test_a_document_ingested_beside_answers_has_the_bits_of_one_ingested_alone(backend):
    scheduler, engine = backend.scheduler, backend.engine
    assert backend.chunk_tokens == engine.chunk_tokens == CHUNK  # documents: the engine's chunk
    prefills = []  # the ingests' PrefillTickets (their results hold the last logits)
    submit_prefill = scheduler.submit_prefill
    scheduler.submit_prefill = lambda *a, **kw: prefills.append(submit_prefill(*a, **kw)) or prefills[-1]
    batch, seen = engine.batch(), []
    step = batch.step

    def counted():  # the layers of an ingest that ran in each decode step's turn, beside its questions
        seen.append((len(batch.members), scheduler.last_slice_layers))
        return step()

    batch.step = counted
    try:
        other = wait_ready(backend, backend.add_document(OTHER, name="other").id)
        # Two answers and the ingest submitted between two steps (on the scheduler's thread): the
        # answers join in the next step and the ingest's first slice runs beside them, whatever the timing.
        answers, beside = scheduler.call(lambda: ([ask(backend, other.id, q, 24) for q in QUESTIONS[:2]],
                                                  backend.add_document(DOCUMENT, name="beside")))
        texts = [answer_text(a) for a in answers]
        beside = wait_ready(backend, beside.id)
        busy = prefills[-1].wait(timeout=120)
        alone = wait_ready(backend, backend.add_document(DOCUMENT, name="alone").id)
        quiet = prefills[-1].wait(timeout=120)
    finally:
        scheduler.submit_prefill = submit_prefill
        del batch.step
    assert any(members and layers for members, layers in seen), "no slice of the ingest ran beside the answers"
    assert texts == [answer_text(ask(backend, other.id, q, 24)) for q in QUESTIONS[:2]]
    assert beside.chunk_tokens == alone.chunk_tokens and set(beside.chunk_tokens[:-1]) == {CHUNK}
    a, b = busy.document, quiet.document
    assert torch.equal(a.token_ids, b.token_ids) and a.rows == b.rows
    assert torch.equal(busy.logits, quiet.logits)
    for layer in range(len(engine.model.layers)):
        assert torch.equal(a.cache.k[layer][:a.rows], b.cache.k[layer][:b.rows])
        assert torch.equal(a.cache.v[layer][:a.rows], b.cache.v[layer][:b.rows])
    assert answer_text(ask(backend, beside.id, QUESTIONS[0], 8)) == answer_text(ask(backend, alone.id, QUESTIONS[0], 8))
