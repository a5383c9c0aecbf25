"""`ringctx serve` for real: the embedded SmolLM2 on two ranks, the real `openai` client, loopback only.

One server (module-scoped) answers most tests; restarts and faults start servers of their own
on a store of their own. Answers are greedy in float32, so they must equal Engine.ask's exactly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
import torch

openai = pytest.importorskip("openai")

NEEDLE = "The secret code for the vault is 7492, and only Marta knows it."
FILLER = "Rivers flow past quiet hills and old towns while the lazy dog sleeps in the sun. "
DOCUMENT = FILLER * 40 + NEEDLE + " " + FILLER * 40
QUESTION = "What is the secret code for the vault?"
GREEDY = dict(max_tokens=16, temperature=0)
LISTENING = re.compile(r"ringctx serve: listening on (http://[\d.]+:\d+)")


class Server:
    """A `ringctx serve` subprocess on 127.0.0.1 with a port the OS picked."""

    def __init__(self, store, *args, env=None, timeout=300, nproc=2):
        self.lines: list[str] = []
        self.store = store
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ringctx", "serve", "--port", "0", "--nproc", str(nproc), "--dtype", "float32",
             "--store", str(store), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        self.url = None
        while self.url is None:
            for line in list(self.lines):
                m = LISTENING.search(line)
                if m:
                    self.url = m.group(1)
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("the server did not start:\n" + "".join(self.lines)[-4000:])
            time.sleep(0.1)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        self.http = httpx.Client(base_url=self.url, timeout=300)

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def ingest(self, text, name="doc"):
        r = self.http.post("/v1/documents", json={"text": text, "name": name})
        assert r.status_code == 202, r.text
        return r.json()

    def wait_ready(self, doc_id, timeout=300):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            doc = self.http.get(f"/v1/documents/{doc_id}").json()
            if doc["status"] not in ("ingesting",):
                return doc
            time.sleep(0.2)
        raise AssertionError(f"{doc_id} still ingesting after {timeout} s")

    def ask(self, doc_id, question, **kw):
        return self.client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": question}],
                                                   extra_body={"document": doc_id}, **{**GREEDY, **kw})

    def metric(self, name):
        text = self.http.get("/metrics").text
        values = [float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith(name) and not line.startswith("#")]
        return sum(values)

    def stop(self, sig=signal.SIGTERM, timeout=120):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.http.close()


@pytest.fixture(scope="module")
def one_process():
    """An Engine in this process (float32) without the prefix cache: the answers the server's must
    equal. (Without the cache, each answer is computed from its whole prompt; a document's ingest
    is the same either way, as nothing was cached before it.)"""
    import ringctx

    with ringctx.Engine(dtype="float32", prefix_cache=False) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(one_process):
    """Engine.ask's greedy answer on the same document (one process, float32)."""
    document = one_process.ingest(DOCUMENT)
    answer = one_process.generate(document, QUESTION, max_new_tokens=16)
    text = "".join(answer)
    one_process.drop_document(document)
    return {"answer": text, "tokens": document.length, "answer_tokens": len(answer.result.token_ids),
            "finish_reason": "length" if answer.result.finish_reason == "length" else "stop"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("store"))
    yield server
    assert server.stop() == 0, "".join(server.lines)[-3000:]


@pytest.fixture(scope="module")
def needle(server):
    return server.wait_ready(server.ingest(DOCUMENT, name="needle")["id"])


def test_models_lists_the_served_model(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["smollm2-135m"]


def test_a_question_on_a_document_equals_engine_ask_and_reports_cached_tokens(server, needle, reference):
    assert needle["status"] == "ready" and needle["tokens"] == reference["tokens"]
    assert needle["chunks"]["done"] == needle["chunks"]["total"] >= 1
    assert sum(needle["chunks"]["tokens"]) == needle["tokens"] and needle["tokens_per_s"] > 0
    response = server.ask(needle["id"], QUESTION)
    assert response.choices[0].message.content == reference["answer"]
    usage = response.usage
    assert usage.prompt_tokens_details.cached_tokens == reference["tokens"]
    assert usage.prompt_tokens > reference["tokens"] and usage.completion_tokens == reference["answer_tokens"]
    assert response.choices[0].finish_reason == reference["finish_reason"]


def test_the_streamed_answer_is_the_same_and_ends_with_usage(server, needle, reference):
    stream = server.ask(needle["id"], QUESTION, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference["answer"]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == reference["tokens"]


def test_a_client_that_resends_the_document_reuses_its_cache(server, needle, reference):
    """No "document" field: the prompt's tokens begin with the document's, so its rows are reused."""
    response = server.client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": DOCUMENT + "\n\n" + QUESTION}], **GREEDY)
    assert response.usage.prompt_tokens_details.cached_tokens == reference["tokens"]
    assert response.choices[0].message.content == reference["answer"]


PLAIN = ("The lighthouse keeper writes down every ship that passes the northern cape, its flag and its cargo. " * 24
         + "The ship that passed at dawn was the Aurora, carrying salt.")


@pytest.fixture(scope="module")
def uncached(one_process):
    """Engine.chat's greedy answer to a conversation without the prefix cache (one process, float32).
    Kept per conversation: greedy answers are deterministic, and the tests ask some conversations
    more than once (another salt, a restarted server)."""
    answers = {}

    def answer(messages):
        key = json.dumps(messages)
        if key not in answers:
            answers[key] = one_process.chat(messages, max_new_tokens=GREEDY["max_tokens"]).text
        return answers[key]

    return answer


def test_a_plain_client_reuses_its_earlier_prompts_and_turns(server, uncached):
    """No documents API: the document in the prompt, questions one after another, then a conversation."""
    before = server.metric("ringctx_prefix_cache_hits")

    def chat(messages, **kw):
        response = server.client.chat.completions.create(model="smollm2-135m", messages=messages, **GREEDY, **kw)
        assert response.choices[0].message.content == uncached(messages)
        return response

    first_turn = [{"role": "user", "content": PLAIN + "\n\nWhich ship passed at dawn?"}]
    first = chat(first_turn)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = chat([{"role": "user", "content": PLAIN + "\n\nWhat does the keeper write down?"}])
    reused = second.usage.prompt_tokens_details.cached_tokens
    assert 256 <= reused < second.usage.prompt_tokens  # the text they share, in whole 64-token blocks
    turn = first_turn + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "And what was it carrying?"}]
    follow_up = chat(turn)
    assert follow_up.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens  # all of turn one
    tenant = chat([{"role": "user", "content": PLAIN + "\n\nWhat does the keeper write down?"}],
                  extra_body={"cache_salt": "tenant-b"})
    assert tenant.usage.prompt_tokens_details.cached_tokens == 0  # another salt never sees these
    assert server.metric("ringctx_prefix_cache_hits") >= before + 2
    assert server.metric('ringctx_prefix_cache_entries{place="memory"}') >= 1
    assert server.metric("ringctx_prefix_cache_tokens_reused") >= reused


def test_a_bad_cache_salt_is_an_error_object(server):
    r = server.http.post("/v1/chat/completions", json={"model": "smollm2-135m", "cache_salt": "",
                                                      "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 422 and r.json()["error"]["param"] == "cache_salt", r.text


def test_completions_and_chat_without_a_document(server):
    completion = server.client.completions.create(model="smollm2-135m", prompt="The capital of France is",
                                                  max_tokens=8, temperature=0)
    assert completion.choices[0].text and completion.usage.prompt_tokens_details.cached_tokens == 0
    again = server.client.completions.create(model="smollm2-135m", prompt="The capital of France is",
                                             max_tokens=8, temperature=0)
    assert again.choices[0].text == completion.choices[0].text
    chat = server.client.chat.completions.create(model="smollm2-135m",
                                                 messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
                                                 temperature=0.8, seed=3)
    assert chat.choices[0].message.content
    same = server.client.chat.completions.create(model="smollm2-135m",
                                                 messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
                                                 temperature=0.8, seed=3)
    assert same.choices[0].message.content == chat.choices[0].message.content  # seeded: reproducible


def test_past_the_trained_context_is_a_400_context_length_exceeded(server):
    """SmolLM2 was trained for 8,192 positions: a document past it, or a prompt whose tokens and
    max_tokens pass it (vLLM's rule), is refused before anything is queued; the server goes on."""
    r = server.http.post("/v1/documents", json={"text": "word " * 9000, "name": "too-long"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["type"], error["param"]) == ("context_length_exceeded", "invalid_request_error", "text")
    assert "trained context of smollm2-135m, 8,192 tokens" in error["message"] and "--rope-scaling" in error["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        server.client.chat.completions.create(model="smollm2-135m", max_tokens=4000,
                                              messages=[{"role": "user", "content": "word " * 4500}])
    assert caught.value.code == "context_length_exceeded" and "4,000 to generate" in caught.value.message
    assert not [d for d in server.http.get("/v1/documents").json()["data"] if d["name"] == "too-long"]


def test_an_unknown_document_is_a_404_object(server):
    r = server.http.post("/v1/chat/completions", json={"model": "smollm2-135m", "document": "doc-" + "0" * 24,
                                                       "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "document"


def run_clients(count, client):
    """client(i) for every i < count, each on a thread of its own, all at once; returns when all have."""
    threads = [threading.Thread(target=client, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)

def test_many_clients_get_their_sequential_answers_while_a_document_is_ingested(server, needle):
    """Bounded: 16 clients x 4 questions over two documents while a third is ingested."""
    other = server.wait_ready(server.ingest(FILLER * 20 + "The ferry leaves at noon.", name="ferry")["id"])
    questions = [(needle["id"], QUESTION), (needle["id"], "Who knows the code?"),
                 (other["id"], "When does the ferry leave?"), (other["id"], "What flows past the hills?")]
    sequential = {q: server.ask(*q, max_tokens=4).choices[0].message.content for q in questions}
    third = server.ingest(FILLER * 120, name="third")
    answers, waits, errors = [], [], []

    def client(i):
        try:
            for j in range(4):
                q = questions[(i + j) % len(questions)]
                t = time.monotonic()
                answers.append((q, server.ask(*q, max_tokens=4).choices[0].message.content))
                waits.append(time.monotonic() - t)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    run_clients(16, client)
    assert not errors, errors
    assert len(answers) == 64 and all(text == sequential[q] for q, text in answers)
    print(f"longest wait for an answer under load: {max(waits):.1f} s (16 clients, their questions decoded together)")
    assert server.wait_ready(third["id"])["status"] == "ready"


def test_eight_streaming_clients_on_one_document_get_their_sequential_answers(server, needle):
    """Eight questions at once stream from one batch (each step decodes every running one); each
    answer equals the one the same request gets alone, greedy and seeded."""
    questions = [QUESTION, "Who knows the code?", "What does the dog do?", "Where do the rivers flow?",
                 "What is the code?", "Is the dog lazy?", "Name the keeper of the code.", "What is near the towns?"]
    sampling = [GREEDY if i % 2 == 0 else dict(max_tokens=16, temperature=0.8, seed=i) for i in range(8)]
    sequential = [server.ask(needle["id"], q, **kw).choices[0].message.content for q, kw in zip(questions, sampling)]
    steps, tokens = server.metric("ringctx_decode_steps"), server.metric("ringctx_decoded_tokens")
    seconds = server.metric("ringctx_decode_step_seconds")
    answers, errors = [None] * 8, []

    def client(i):
        try:
            stream = server.ask(needle["id"], questions[i], stream=True, **sampling[i])
            answers[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    run_clients(8, client)
    assert not errors, errors
    assert answers == sequential
    steps, tokens = server.metric("ringctx_decode_steps") - steps, server.metric("ringctx_decoded_tokens") - tokens
    seconds = server.metric("ringctx_decode_step_seconds") - seconds
    # every step decoded a token for at least one answer, and fewer steps ran than tokens (batched)
    assert 0 < steps < tokens <= 8 * steps and seconds > 0
    print(f"8 streaming clients: {tokens:.0f} tokens in {steps:.0f} batched steps (mean batch {tokens / steps:.1f}, "
          f"mean step {1e3 * seconds / steps:.1f} ms)")


def test_a_client_that_disconnects_mid_answer_frees_its_rows(server, needle):
    assert server.metric("ringctx_max_batch") == 16 and server.metric("ringctx_max_step_tokens") > 16
    assert server.metric("ringctx_join_share") == 1.0
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=300, json={
            "model": "smollm2-135m", "document": needle["id"], "stream": True, "max_tokens": 4000,
            "messages": [{"role": "user", "content": QUESTION}], "temperature": 0}) as response:
        # an answer token has arrived: the question is decoding
        next(line for line in response.iter_lines() if '"content":"' in line and '"content":""' not in line)
        assert server.metric("ringctx_answer_rows") >= 4000 and server.metric("ringctx_batch_size") == 1
    # The connection is closed: the server cancels the answer, which leaves the batch at its next step.
    deadline = time.monotonic() + 120
    while (server.metric("ringctx_answer_rows"), server.metric("ringctx_batch_size")) != (0, 0):
        assert time.monotonic() < deadline, "the rows of a disconnected client were never freed"
        time.sleep(0.2)
    assert server.ask(needle["id"], QUESTION).choices[0].message.content  # and the server goes on


def test_a_ready_document_is_saved_in_the_background_and_a_delete_meanwhile_leaves_nothing(server):
    """Ready means answerable from memory; the store has it once its slices are written (a save
    must not pause answers). Deleted straight away, maybe mid-save, nothing of it stays."""
    kept = server.wait_ready(server.ingest(FILLER * 30, name="kept")["id"])
    deadline = time.monotonic() + 120
    while server.http.get(f"/v1/documents/{kept['id']}").json()["kv"]["bytes_on_disk"] == 0:
        assert time.monotonic() < deadline, "the document never reached the store"
        time.sleep(0.1)
    assert (server.store / f"{kept['id']}.kv" / "manifest.json").exists()
    gone = server.wait_ready(server.ingest(FILLER * 30, name="gone")["id"])
    assert server.http.delete(f"/v1/documents/{gone['id']}").status_code == 200
    assert server.http.get(f"/v1/documents/{gone['id']}").status_code == 404
    deadline = time.monotonic() + 120
    while list(server.store.glob(f"{gone['id']}*")):
        assert time.monotonic() < deadline, f"left behind: {list(server.store.glob(gone['id'] + '*'))}"
        time.sleep(0.1)
    assert server.ask(kept["id"], "What flows past the hills?").choices[0].message.content
    assert not any("could not be saved" in line for line in server.lines)


def test_restart_answers_from_the_store_without_prefilling(tmp_path, reference, uncached):
    """Documents and cached prompts both come back; a damaged cached prompt is a miss and one line."""
    def chat(server, text, question):
        messages = [{"role": "user", "content": text + "\n\n" + question}]
        response = server.client.chat.completions.create(model="smollm2-135m", messages=messages, **GREEDY)
        assert response.choices[0].message.content == uncached(messages)
        return response.usage.prompt_tokens_details.cached_tokens

    other = PLAIN.replace("lighthouse keeper", "harbour pilot")
    first = Server(tmp_path)
    doc = first.wait_ready(first.ingest(DOCUMENT)["id"])
    assert chat(first, PLAIN, "Which ship passed at dawn?") == 0 and chat(first, other, "Who writes?") == 0
    assert first.stop() == 0
    assert any("2 cached prompt(s) saved" in line for line in first.lines), "".join(first.lines)[-2000:]
    damaged = sorted((tmp_path / "prefix-cache").glob("pfx-*.kv"))[0]  # one of the two, whichever
    slice_file = sorted(damaged.glob("slice-*.safetensors"))[0]
    data = bytearray(slice_file.read_bytes())
    data[-16] ^= 0xFF
    slice_file.write_bytes(bytes(data))
    second = Server(tmp_path)
    try:
        listed = second.http.get("/v1/documents").json()["data"]
        assert [(d["id"], d["status"]) for d in listed] == [(doc["id"], "on_disk")]
        assert second.ask(doc["id"], QUESTION).choices[0].message.content == reference["answer"]
        assert second.metric("ringctx_document_chunks_prefilled") == 0
        assert second.http.get(f"/v1/documents/{doc['id']}").json()["status"] == "ready"
        assert second.metric('ringctx_prefix_cache_entries{place="disk"}') == 2
        reused = [chat(second, PLAIN, "What does the keeper write down?"), chat(second, other, "What is carried?")]
        assert sorted(reused)[0] == 0 and sorted(reused)[1] > 256  # the damaged one a miss, the other loaded
        assert second.metric("ringctx_prefix_cache_loads") == 1
        assert any("does not load" in line for line in second.lines), "".join(second.lines)[-2000:]
    finally:
        assert second.stop() == 0


def test_a_server_killed_past_half_an_ingest_resumes_it_at_restart_bit_for_bit(tmp_path, reference):
    """SIGKILL the server past half a document's chunks: the next server on the store resumes the
    ingest from its checkpoint without being asked (the client sees it "ingesting" with the chunks
    done), and the document it saves is bit for bit the one an ingest that never stopped saves."""
    first = Server(tmp_path, "--chunk-tokens", "128")
    whole = first.wait_ready(first.ingest(DOCUMENT, name="whole")["id"])
    doc = first.ingest(DOCUMENT, name="killed")
    total = doc["chunks"]["total"]
    deadline = time.monotonic() + 120
    while first.http.get(f"/v1/documents/{doc['id']}").json()["chunks"]["done"] <= total // 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    ranks = psutil.Process(first.proc.pid).children(recursive=True)
    first.stop(signal.SIGKILL)
    _, left = psutil.wait_procs(ranks, timeout=120)  # its ranks see rank 0's pipe close and exit
    assert not left, f"ranks outlived a killed server: {left}"
    assert (tmp_path / f"{doc['id']}.ingest").is_dir()
    second = Server(tmp_path, "--chunk-tokens", "128")
    try:
        seen = second.http.get(f"/v1/documents/{doc['id']}").json()
        assert seen["status"] in ("ingesting", "ready"), seen
        if seen["status"] == "ingesting":
            assert seen["chunks"]["done"] > total // 2 - 2, seen  # at most the chunks in flight were lost
        resumed = second.wait_ready(doc["id"])
        assert resumed["status"] == "ready", resumed
        assert any("resuming" in line for line in second.lines), "".join(second.lines)[-2000:]
        assert second.ask(doc["id"], QUESTION).choices[0].message.content == reference["answer"]
        assert second.ask(whole["id"], QUESTION).choices[0].message.content == reference["answer"]
        deadline = time.monotonic() + 60
        while (tmp_path / f"{doc['id']}.ingest").exists():  # it goes once the KV cache is saved
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert not list(tmp_path.glob("*.partial"))
    finally:
        assert second.stop() == 0
    assert _saved_tensors(tmp_path / f"{doc['id']}.kv") == _saved_tensors(tmp_path / f"{whole['id']}.kv")


def _saved_tensors(path) -> dict:
    """Every tensor of a saved document's slices, as bytes by (slice file, name)."""
    from safetensors.torch import load_file

    return {(f.name, name): t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            for f in sorted(path.glob("slice-*.safetensors")) for name, t in load_file(str(f)).items()}


def test_a_rank_lost_while_answering_is_a_503_naming_it_and_the_server_exits_non_zero(tmp_path):
    server = Server(tmp_path, env={"RINGCTX_TEST_KILL": "1:decode5"})
    try:
        doc = server.wait_ready(server.ingest(FILLER * 10)["id"])
        r = server.http.post("/v1/chat/completions", json={"model": "smollm2-135m", "document": doc["id"],
                                                           "messages": [{"role": "user", "content": QUESTION}],
                                                           "max_tokens": 32, "temperature": 0})
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert "rank 1 of 2" in error["message"] and error["code"] == "rank_lost"
        assert server.proc.wait(timeout=120) != 0
    finally:
        server.stop(signal.SIGKILL)
    assert (tmp_path / f"{doc['id']}.kv").is_dir()  # the store is intact
    json.loads((tmp_path / f"{doc['id']}.json").read_text())
