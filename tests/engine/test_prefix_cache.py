"""The prefix cache (ringctx/engine/prefix_cache.py) through Engine.chat, on one and two decode ranks.

Every answer with a hit is compared with the same prompt answered without the cache (prefilled
whole over every rank, its last token asked on it: what a miss runs): float32 greedy tokens
identical, logits within float rounding. Scenarios: a whole entry, a partial match (a branch), a
match ending inside a block, a conversation of five turns, two questions on one entry at once,
eviction to disk and back, a restart on the same directory, damaged files, a budget too small,
a directory that cannot be written, salts.
"""

from __future__ import annotations

import json

import pytest
import torch

from ringctx import Engine
from ringctx.engine.prefix_cache import BLOCK_TOKENS, PrefixCache, block_hashes, engine_seed, prefix_seed

MIN_TOKENS = 64
LOGITS_ATOL = 2e-4  # float32: the two runs sum attention over differently split rows


@pytest.fixture(scope="module", params=[1, 2], ids=["one-rank", "two-ranks"])
def engine(request):
    with Engine("tiny", dtype="float32", nproc=request.param, chunk_tokens=96, timeout_s=60,
                prefix_cache_min_tokens=MIN_TOKENS) as built:
        yield built


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 250, (n,), generator=g).tolist()


def uncached(engine, ids, max_new_tokens=6):
    """The answer without the cache: the prompt prefilled over every rank, its last token asked on it."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    document = engine.prefill(ids[:-1], as_document=True, decode_room=64).document
    batch = engine.batch()
    member = batch.join(document, ids[-1:], max_new_tokens=max_new_tokens, keep_logits=True)
    while not member.left:
        batch.step()
    return member.result


def check_same(got, want):
    assert got.token_ids == want.token_ids
    diff = max(float((a - b).abs().max()) for a, b in zip(got.step_logits, want.step_logits))
    assert diff <= LOGITS_ATOL, diff


def fresh_cache(engine, **kwargs) -> PrefixCache:
    """The engine's chat cache replaced by a new one (tests of its own budget or directory)."""
    engine.prefix_cache.clear()
    options = dict(bytes_per_token=engine.prefix_cache.bytes_per_token, budget_bytes=2**30, min_tokens=MIN_TOKENS)
    engine._prefix_cache = PrefixCache(engine, **{**options, **kwargs})
    return engine._prefix_cache


def test_hash_chain_blocks_and_seeds():
    ids = torch.arange(3 * BLOCK_TOKENS + 5)
    seed = prefix_seed("m", "float32", "model", None)
    chain = block_hashes(seed, ids)
    assert len(chain) == 3 and len(set(chain)) == 3
    assert block_hashes(seed, ids[:2 * BLOCK_TOKENS]) == chain[:2]  # a prefix's chain is the chain's prefix
    changed = ids.clone()
    changed[BLOCK_TOKENS + 1] += 1
    other = block_hashes(seed, changed)
    assert other[0] == chain[0] and other[1:] != chain[1:]  # a change reaches every later link
    for key in [("m2", "float32", "model", None), ("m", "bfloat16", "model", None), ("m", "float32", "fp8", None),
                ("m", "float32", "model", "{{ other template }}"), ("m", "float32", "model", None, "tenant")]:
        assert block_hashes(prefix_seed(*key), ids)[0] != chain[0], key


def test_lookup_finds_whole_partial_and_nothing_under_the_threshold(engine):
    cache = fresh_cache(engine)
    seed = engine_seed(engine)
    base = tokens(200, 1)
    document = engine.prefill(torch.tensor(base), as_document=True).document
    cache.add(document, seed)
    whole = cache.lookup(torch.tensor(base + [5, 6]), seed)
    assert whole.whole and whole.tokens == 200
    assert cache.lookup(torch.tensor(base[:150] + [7] * 40), seed).tokens == 150  # to the token
    assert cache.lookup(torch.tensor(base[:100] + [7] * 40), seed).tokens == 100
    assert cache.lookup(torch.tensor(base[:50] + [7] * 40), seed) is None  # under min_tokens
    assert cache.lookup(torch.tensor(base), seed).tokens == 199  # a question keeps a token of its own
    assert cache.lookup(torch.tensor(base + [5]), engine_seed(engine, "tenant-b")) is None
    stats = cache.stats()
    assert stats.entries_in_memory == 1 and stats.bytes_in_memory == 200 * cache.bytes_per_token


def test_a_conversation_and_its_branches_answer_as_without_the_cache(engine):
    fresh_cache(engine)
    document = tokens(300, 2)
    first = engine.chat(document + [11, 12, 13], max_new_tokens=6, keep_logits=True)
    assert first.cached_tokens == 0
    check_same(first, uncached(engine, document + [11, 12, 13]))
    # another question on the same text: a view of the first prompt's rows to where they part
    second_ids = document + [21, 22]
    second = engine.chat(second_ids, max_new_tokens=6, keep_logits=True)
    assert second.cached_tokens == 300
    check_same(second, uncached(engine, second_ids))
    # a third that parts earlier: another view, nothing copied
    third_ids = document[:290] + [31, 32, 33]
    third = engine.chat(third_ids, max_new_tokens=6, keep_logits=True)
    assert third.cached_tokens == 290
    check_same(third, uncached(engine, third_ids))
    # the second's next turn reaches into its kept turn (its own rows after the view): joined, one copy
    fourth_ids = second_ids + second.token_ids + [23]
    fourth = engine.chat(fourth_ids, max_new_tokens=6, keep_logits=True)
    assert fourth.cached_tokens == len(second_ids) + len(second.token_ids) - 1
    check_same(fourth, uncached(engine, fourth_ids))
    assert engine.prefix_cache.stats().tails_joined == 1 and engine.prefix_cache.stats().partial_hits >= 2
    # a question that starts like a kept turn's (not its next turn) views the rows before it: no copy
    fifth_ids = third_ids[:291] + [77, 78]  # the third's question's first token, then another question
    fifth = engine.chat(fifth_ids, max_new_tokens=6, keep_logits=True)
    assert fifth.cached_tokens == 290 and engine.prefix_cache.stats().tails_joined == 1
    check_same(fifth, uncached(engine, fifth_ids))
    # five turns: each sends the whole conversation; the previous turn and its answer are reused
    conversation, previous = document + [41, 42], None
    for turn in range(5):
        result = engine.chat(conversation, max_new_tokens=5, keep_logits=True)
        check_same(result, uncached(engine, conversation, max_new_tokens=5))
        if previous is not None:  # all of the last prompt, and its answer but the last token (no row)
            assert result.cached_tokens == previous + 4, (turn, result.cached_tokens)
        previous = len(conversation)
        conversation = conversation + result.token_ids + [50 + turn, 60 + turn]
    assert engine.prefix_cache.stats().hits >= 6


def test_a_conversation_whose_client_retells_the_answer_otherwise_grows_its_entry_without_copies(engine):
    """A client sends the last answer back as text, which may tokenize otherwise than it was sampled:
    the conversation's own entry is cut back to where the turn parts and grows again, no copy."""
    cache = fresh_cache(engine)
    conversation = tokens(300, 19) + [41, 42]
    for turn in range(4):
        result = engine.chat(conversation, max_new_tokens=5, keep_logits=True)
        check_same(result, uncached(engine, conversation, max_new_tokens=5))
        if turn:
            assert result.cached_tokens == len(conversation) - 5  # all but the retold part of the answer, and the message
        retold = result.token_ids[:2] + [(t + 1) % 250 + 1 for t in result.token_ids[2:]]  # parts after 2 tokens
        conversation = conversation + retold + [50 + turn, 60 + turn]
    stats = cache.stats()
    assert stats.cuts == 3 and stats.tails_joined == 0 and stats.entries_in_memory == 1


def test_a_hit_that_ends_inside_a_block_and_one_on_every_token(engine):
    fresh_cache(engine, min_tokens=1)
    base = tokens(2 * BLOCK_TOKENS + 17, 3)  # not a whole number of blocks
    engine.chat(base, max_new_tokens=1)
    for cut in (BLOCK_TOKENS + 1, 2 * BLOCK_TOKENS, 2 * BLOCK_TOKENS + 9):
        ids = base[:cut] + [99, 98, 97]
        result = engine.chat(ids, max_new_tokens=4, keep_logits=True)
        assert result.cached_tokens == cut
        check_same(result, uncached(engine, ids, max_new_tokens=4))


def test_two_questions_on_one_entry_at_once(engine):
    cache = fresh_cache(engine)
    seed = engine_seed(engine)
    base = tokens(200, 4)
    cache.add(engine.prefill(torch.tensor(base), as_document=True).document, seed)
    from ringctx.engine.prefix_cache import CachedPrompt

    batch, prompts, members = engine.batch(), [], []
    for question in ([1, 2, 3], [4, 5]):
        ids = torch.tensor(base + question)
        match = cache.lookup(ids, seed)
        prompt = CachedPrompt(cache, seed, match, ids, match.tokens)
        members.append(batch.join(prompt.document(engine), ids[match.tokens:], max_new_tokens=5, keep=prompt.keep,
                                  keep_logits=True))
        prompts.append(prompt)
    assert members[0].document is members[1].document  # one entry, read by both
    while batch.members:
        for member, piece in batch.step():
            if piece is None:
                prompts[members.index(member)].left(member)
    for member, question in zip(members, ([1, 2, 3], [4, 5])):
        check_same(member.result, uncached(engine, base + question, max_new_tokens=5))
    # the first to finish was copied (the other still read the entry), the last grew the entry in place
    kept = [m.kept for m in members]
    assert sum(k is members[0].document for k in kept) <= 1
    assert all(k is not None for k in kept)


def test_eviction_to_disk_and_back_and_a_restart(engine, tmp_path):
    per_token = engine.prefix_cache.bytes_per_token
    cache = fresh_cache(engine, budget_bytes=300 * per_token, directory=tmp_path, disk_budget_bytes=2**30)
    a, b = tokens(200, 5), tokens(200, 6)
    answer_a = engine.chat(a + [1, 2], max_new_tokens=3).token_ids
    answer_b = engine.chat(b + [1, 2], max_new_tokens=3).token_ids  # a leaves memory for the disk
    stats = cache.stats()
    assert stats.evicted_to_disk == 1 and stats.entries_on_disk == 1 and stats.bytes_in_memory <= 300 * per_token
    turn = a + [1, 2] + answer_a + [7, 7, 7]
    result = engine.chat(turn, max_new_tokens=4, keep_logits=True)  # a comes back, with its answer
    assert result.cached_tokens == 202 + 2 and cache.stats().loaded_from_disk == 1
    check_same(result, uncached(engine, turn, max_new_tokens=4))
    cache.save_all()
    saved = cache.stats().entries_on_disk
    assert saved >= 2
    restarted = fresh_cache(engine, budget_bytes=300 * per_token, directory=tmp_path, disk_budget_bytes=2**30)
    assert restarted.stats().entries_on_disk == saved and restarted.stats().entries_in_memory == 0
    turn = b + [1, 2] + answer_b + [8, 8]
    again = engine.chat(turn, max_new_tokens=4, keep_logits=True)
    assert again.cached_tokens == 202 + 2 and restarted.stats().loaded_from_disk == 1
    check_same(again, uncached(engine, turn, max_new_tokens=4))


def test_disk_budget_keeps_the_most_recent(engine, tmp_path):
    per_token = engine.prefix_cache.bytes_per_token
    cache = fresh_cache(engine, budget_bytes=250 * per_token, directory=tmp_path, disk_budget_bytes=1)
    engine.chat(tokens(200, 7) + [1], max_new_tokens=2)
    engine.chat(tokens(200, 8) + [1], max_new_tokens=2)
    stats = cache.stats()  # nothing fits a 1-byte disk: the entry that left memory was dropped
    assert stats.evicted_dropped == 1 and stats.entries_on_disk == 0 and not list(tmp_path.glob("pfx-*"))


def test_a_damaged_entry_is_deleted_with_one_line_and_the_prompt_answered(engine, tmp_path):
    lines = []
    per_token = engine.prefix_cache.bytes_per_token
    cache = fresh_cache(engine, budget_bytes=250 * per_token, directory=tmp_path, disk_budget_bytes=2**30,
                        log=lines.append)
    a = tokens(200, 9)
    engine.chat(a + [1], max_new_tokens=2)
    engine.chat(tokens(200, 10) + [1], max_new_tokens=2)  # a is on disk now
    (entry_dir,) = [p for p in tmp_path.glob("pfx-*.kv") if p.is_dir()]
    slice_file = sorted(entry_dir.glob("slice-*.safetensors"))[0]
    data = bytearray(slice_file.read_bytes())
    data[-10] ^= 0xFF
    slice_file.write_bytes(bytes(data))
    result = engine.chat(a + [1, 5, 5], max_new_tokens=3, keep_logits=True)
    assert result.cached_tokens == 0  # the entry did not load: a miss
    check_same(result, uncached(engine, a + [1, 5, 5], max_new_tokens=3))
    assert any("does not load" in line for line in lines), lines
    assert not entry_dir.exists()
    # a damaged record is deleted when the directory is opened again
    (record,) = list(tmp_path.glob("pfx-*.json"))[:1] or [None]
    if record is not None:
        record.write_text("{not json")
        lines.clear()
        fresh_cache(engine, directory=tmp_path, disk_budget_bytes=2**30, log=lines.append)
        assert any("is damaged" in line for line in lines) and not record.exists()


def test_a_budget_too_small_keeps_nothing_and_answers(engine):
    lines = []
    cache = fresh_cache(engine, budget_bytes=10, log=lines.append)
    ids = tokens(200, 11) + [1, 2]
    result = engine.chat(ids, max_new_tokens=3, keep_logits=True)
    check_same(result, uncached(engine, ids, max_new_tokens=3))
    assert cache.stats().entries_in_memory == 0 and cache.stats().not_kept >= 1
    assert any("larger than the cache's budget" in line for line in lines), lines
    assert engine.chat(ids, max_new_tokens=3).cached_tokens == 0


def test_a_directory_that_cannot_be_written_keeps_prompts_in_memory(engine, tmp_path):
    lines = []
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = fresh_cache(engine, directory=blocker / "cache", log=lines.append)
    assert cache.directory is None and len(lines) == 1 and "cannot be written" in lines[0]
    ids = tokens(200, 12)
    engine.chat(ids + [1], max_new_tokens=2)
    assert engine.chat(ids + [1, 2, 3], max_new_tokens=2).cached_tokens > 0


def test_salts_keep_tenants_apart(engine):
    fresh_cache(engine)
    ids = tokens(200, 13)
    engine.chat(ids + [1], max_new_tokens=2, cache_salt="tenant-a")
    assert engine.chat(ids + [2, 3], max_new_tokens=2, cache_salt="tenant-b").cached_tokens == 0
    assert engine.chat(ids + [2, 3], max_new_tokens=2).cached_tokens == 0
    assert engine.chat(ids + [4, 5], max_new_tokens=2, cache_salt="tenant-a").cached_tokens > 0


def test_off_means_off():
    with Engine("tiny", dtype="float32", prefix_cache=False) as engine:
        ids = tokens(200, 14)
        engine.chat(ids + [1], max_new_tokens=2)
        assert engine.prefix_cache is None and engine.chat(ids + [1, 2], max_new_tokens=2).cached_tokens == 0


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="prefix_cache_min_tokens"):
        Engine("tiny", prefix_cache_min_tokens=0)
    with pytest.raises(ValueError, match="prefix_cache_share"):
        Engine("tiny", prefix_cache_share=1.5)


def test_records_are_json_and_checked(engine, tmp_path):
    per_token = engine.prefix_cache.bytes_per_token
    cache = fresh_cache(engine, budget_bytes=250 * per_token, directory=tmp_path, disk_budget_bytes=2**30)
    engine.chat(tokens(200, 15) + [1], max_new_tokens=2)
    engine.chat(tokens(200, 16) + [1], max_new_tokens=2)
    (record,) = tmp_path.glob("pfx-*.json")
    data = json.loads(record.read_text())
    assert data["format"] == "ringctx-prefix-entry/1" and data["id"] == record.stem and data["tokens"] == 201 + 2 - 1  # the prompt, the answer but its last token
    assert cache.stats().entries_on_disk == 1


def test_a_long_rest_is_prefilled_a_chunk_per_step_on_a_copy(engine):
    from ringctx.engine.prefix_cache import CachedPrompt
    from ringctx.engine.scheduler import Done, Scheduler
    from ringctx.engine.work_items import Prefill, Question

    cache = fresh_cache(engine)
    seed = engine_seed(engine)
    base = tokens(200, 17)
    engine.chat(base + [1], max_new_tokens=2)
    (entry,) = cache.entries.values()
    kept = entry.length
    ids = torch.tensor(base + [1] + tokens(130, 18))
    match = cache.lookup(ids, seed)
    prompt = CachedPrompt(cache, seed, match, ids, match.tokens)
    rest, chunks = ids[match.tokens:], []
    scheduler = Scheduler(engine)
    try:
        ticket = scheduler.submit_question_after(
            Prefill(rest[:-1], chunk_tokens=40, on_top=prompt.private_copy),
            Question(rest[-1:], len(rest), dict(max_new_tokens=4, keep_logits=True), keep=prompt.keep,
                     on_leave=prompt.left),
            ready=prompt.prefilled, on_chunk=lambda job, stats: chunks.append(stats.tokens))
        result = [e for e in ticket if isinstance(e, Done)][0].result
    finally:
        scheduler.stop()
    assert chunks == [40, 40, 40, len(rest) - 1 - 120]
    # the entry was cut back to where the prompt parts inside its answer, its rows copied, the copy extended
    assert kept == match.tokens + 1 and entry.length == entry.document.length == match.tokens
    check_same(result, uncached(engine, ids, max_new_tokens=4))
