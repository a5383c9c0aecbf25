"""The engine on the real embedded SmolLM2-135M-Instruct: W = 2 against W = 1 and transformers,
long-document retrieval, KV files, and the CLI."""

import random
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from ringctx.cli import main
from ringctx.engine import Engine

SECRET = "The secret code for the vault is 7492, and only Marta knows it."
QUESTION = "What is the secret code for the vault?"


def long_document(sentences: int = 260) -> str:
    """Several thousand tokens of filler with one fact hidden in the middle."""
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while rivers flow past quiet hills and old towns".split()
    text = [" ".join(rng.choice(words) for _ in range(12)).capitalize() + "." for _ in range(sentences)]
    text.insert(sentences * 3 // 5, SECRET)
    return " ".join(text)


@pytest.fixture(scope="module")
def engine1():
    return Engine("smollm2-135m", dtype="float32")


@pytest.fixture(scope="module")
def engine2():
    with Engine("smollm2-135m", nproc=2, dtype="float32", chunk_tokens=1024) as engine:
        yield engine


@pytest.fixture(scope="module")
def document2(engine2):
    return engine2.ingest(long_document())


def test_two_ranks_equal_one_rank_and_transformers(engine1, engine2, smollm2_hf):
    ids = engine1.model.tokenizer(long_document(40))["input_ids"]
    r1 = engine1.prefill(ids, chunk_tokens=len(ids))
    r2 = engine2.prefill(ids, chunk_tokens=97, as_document=True)  # several chunks, both strategies possible
    assert len(r2.stats.chunks) > 1
    torch.testing.assert_close(r2.logits, r1.logits, atol=1e-4, rtol=1e-4)
    rows = r2.stats.decode_slice_rows_per_rank  # each decode rank keeps its half of the tokens
    assert sum(rows) == len(ids) and abs(rows[0] - rows[1]) <= 97
    whole = engine2.whole_cache(r2.document)  # the two slices, gathered in sequence order for the check
    engine2.drop_document(r2.document)
    for layer in (0, 29):
        torch.testing.assert_close(whole.k[layer][:len(ids)], r1.cache.k[layer][:len(ids)], atol=1e-4, rtol=0)
    with torch.inference_mode():  # transformers' float32 model of the embedded GGUF (tests/conftest.py)
        hf_logits = smollm2_hf(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
    rel = (r2.logits - hf_logits).abs().max() / hf_logits.abs().max()
    assert rel < 1e-4, f"relative max error {rel:.2e} against transformers"


def test_retrieves_a_fact_hidden_in_a_long_document(engine2, document2):
    assert document2.length > 3000
    assert len(document2.stats.chunks) >= 3 and document2.stats.world_size == 2
    answer = engine2.ask(document2, QUESTION, max_new_tokens=24)
    assert "7492" in answer, answer


def test_greedy_answer_after_two_ranks_equals_one_rank(engine1, engine2, document2):
    document1 = engine1.ingest(long_document())
    assert engine2.decode_ranks == 2 and document2.cache.length < document2.length  # split over two ranks
    torch.testing.assert_close(document1.cache.k[5][:document1.length],
                               engine2.whole_cache(document2).k[5][:document2.length], atol=1e-4, rtol=0)
    question = "Summarize the document in one sentence."
    g1 = engine1.generate(document1, question, max_new_tokens=24)
    g2 = engine2.generate(document2, question, max_new_tokens=24)
    "".join(g1), "".join(g2)
    assert g1.result.token_ids == g2.result.token_ids


def test_kv_file_round_trip_and_errors(engine1, engine2, document2, tmp_path):
    path = tmp_path / "doc.kv"
    expected = engine2.ask(document2, QUESTION, max_new_tokens=12)
    engine2.save_document(document2, str(path))
    loaded = engine1.load_document(str(path))
    assert loaded.length == document2.length and torch.equal(loaded.token_ids, document2.token_ids)
    assert engine1.ask(loaded, QUESTION, max_new_tokens=12) == expected
    assert engine1.ask(loaded, QUESTION, max_new_tokens=12) == expected  # questions do not see each other

    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "slice-00000.safetensors",
                                                      "slice-00001.safetensors", "tokens.safetensors"]
    truncated = tmp_path / "truncated.kv"
    shutil.copytree(path, truncated)
    data = (path / "slice-00001.safetensors").read_bytes()
    (truncated / "slice-00001.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="slice-00001.safetensors fails its checksum"):
        engine1.load_document(str(truncated))
    altered = tmp_path / "altered.kv"
    shutil.copytree(path, altered)
    (altered / "slice-00000.safetensors").write_bytes(data[:-10] + bytes(b ^ 0xFF for b in data[-10:]))
    with pytest.raises(ValueError, match="checksum"):
        engine1.load_document(str(altered))
    (altered / "manifest.json").unlink()  # a save that never finished leaves no manifest
    with pytest.raises(ValueError, match="no readable manifest.json"):
        engine1.load_document(str(altered))
    with pytest.raises(ValueError, match="does not exist"):
        engine1.load_document(str(tmp_path / "missing.kv"))
    other = Engine("tiny", dtype="float32")
    with pytest.raises(ValueError, match="made with model 'smollm2-135m'"):
        other.load_document(str(path))


def cli_ingest(tmp_path, repeats, *options):
    """`ringctx ingest` of long_document(repeats) on one rank (not --nproc auto's two: this module's
    two-rank engine holds this process's group) with `options`: (runner, doc, kv path, result)."""
    doc = tmp_path / "doc.txt"
    doc.write_text(long_document(repeats))
    kv = tmp_path / "doc.kv"
    runner = CliRunner()
    result = runner.invoke(main, ["ingest", str(doc), "--save", str(kv), *options, "--nproc", "1"])
    assert result.exit_code == 0, result.output
    return runner, doc, kv, result


def test_cli_ingest_and_ask(tmp_path):
    runner, doc, kv, result = cli_ingest(tmp_path, 60, "--dtype", "float32", "--chunk-tokens", "256")
    assert "time to first token" in result.output and kv.exists()
    result = runner.invoke(main, ["ask", str(kv), QUESTION, "--max-new-tokens", "16"])
    assert result.exit_code == 0, result.output
    assert "7492" in result.output
    # saved by one decode rank, asked on two (resliced on load, decoded together); in a process of
    # its own, as this module's two-rank engine holds this process's group
    two = subprocess.run([sys.executable, "-m", "ringctx", "ask", str(kv), QUESTION, "--max-new-tokens", "16",
                          "--nproc", "2"], capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "7492" in two.stdout and "on 2 decode rank(s)" in two.stderr
    result = runner.invoke(main, ["ask", str(kv), "  ", "--max-new-tokens", "16"])
    assert result.exit_code != 0 and "the question is empty" in result.output


def test_cli_int8_weights_find_the_needle_and_ask_reads_them_from_the_document(tmp_path):
    """SmolLM2 with int8 weights (bf16 activations) still finds the needle; `ask` loads the model
    as the document's manifest says it was made (int8), without being told."""
    runner, doc, kv, _ = cli_ingest(tmp_path, 30, "--dtype", "bf16", "--weights", "int8")
    result = runner.invoke(main, ["ask", str(kv), QUESTION, "--max-new-tokens", "16"])
    assert result.exit_code == 0, result.output
    assert "7492" in result.output
    result = runner.invoke(main, ["ingest", str(doc), "--save", str(kv), "--dtype", "float16", "--weights", "int8",
                                  "--nproc", "1"])
    assert result.exit_code != 0 and "int8 weights need a bfloat16 or float32 model" in result.output


def test_cli_asks_several_questions_together(tmp_path):
    runner, doc, kv, _ = cli_ingest(tmp_path, 30, "--dtype", "float32")
    questions = [QUESTION, "Who knows the code?"]
    alone = [runner.invoke(main, ["ask", str(kv), q, "--max-new-tokens", "12"]) for q in questions]
    assert all(r.exit_code == 0 for r in alone), alone[0].output
    # both at once on two decode ranks, in a process of its own (this module's engine holds the group)
    both = subprocess.run([sys.executable, "-m", "ringctx", "ask", str(kv), *questions, "--max-new-tokens", "12",
                           "--nproc", "2"], capture_output=True, text=True, timeout=300)
    assert both.returncode == 0, both.stderr[-3000:]
    assert "2 questions answered together" in both.stderr
    expected = "".join(f"[{i + 1}] {q}\n{r.stdout.strip()}\n\n" for i, (q, r) in enumerate(zip(questions, alone)))
    assert both.stdout == expected and "7492" in both.stdout
    result = runner.invoke(main, ["ask", str(kv), QUESTION, " ", "--max-new-tokens", "4"])
    assert result.exit_code != 0 and "the question 2 is empty" in result.output


@pytest.mark.parametrize("content,message", [(b"", "is empty"), (b"\xff\xfe\x00bad", "not UTF-8"), (None, "no such file")])
def test_cli_ingest_bad_documents(tmp_path, content, message):
    doc = tmp_path / "doc.txt"
    if content is not None:
        doc.write_bytes(content)
    kv = tmp_path / "doc.kv"
    result = CliRunner().invoke(main, ["ingest", str(doc), "--save", str(kv)])
    assert result.exit_code != 0 and message in result.output
    assert not kv.exists()
