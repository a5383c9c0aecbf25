"""`ringctx serve` on tiny random families, over HTTP, against transformers: a mixture of experts
(Qwen3-MoE) and a linear-attention hybrid (Qwen3.5: Gated DeltaNet layers whose state the served
document keeps, each question starting from a copy of it).

The live-server tests run the embedded SmolLM2; these serve a family the way its users get it: a
Hugging Face directory with its weights (tests/model/test_model_moe.py's random configs, saved by
transformers) and a tokenizer with a chat template (a small word-level one built here with the
`tokenizers` library, since no hub is reached). A document ingested over HTTP and questions about
it, asked one by one and by two clients at once (the scheduler batches them), and a chat without a
document, answer greedily as transformers' generate does on the same token ids.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from tests.helpers import SavedHFModels
from tests.model.test_model_moe import random_hf_model as random_moe_model
from tests.model.test_model_qwen3_5 import random_hf_model as random_hybrid_model

from .test_live_server import Server

openai = pytest.importorskip("openai")

SPECIAL = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>", "[UNK]"]
"""Ids 0-4: pad, bos and eos as the test configs number them (0, 1, 2), the chat markers, unknown."""

WORDS = ("user assistant system the a of to and in is was for on that with as by at from it an be this are or which his "
         "vault code secret marta knows only river hill town dog sun quiet old lazy sleeps flows past "
         "what who where when how does sleep many one two three four five six seven eight nine zero").split()

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
"""ChatML's shape with spaces between words (the word-level tokenizer splits on them)."""

DOCUMENT = " ".join(["the quiet river flows past the old town and the lazy dog sleeps in the sun"] * 6 +
                    ["the secret code of the vault is seven four nine two and only marta knows it"] +
                    ["the quiet river flows past the old town"] * 4)
QUESTIONS = ["what is the secret code of the vault", "who knows the code", "where does the dog sleep"]
ANSWER_TOKENS = 8


def save_word_tokenizer(directory: str, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` ids (the special ones, WORDS, then filler words w<i>)
    with CHAT_TEMPLATE, saved into `directory` beside the model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIAL + WORDS + [f"w{i}" for i in range(vocab_size - len(SPECIAL) - len(WORDS))]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces, as they were split
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>",
                                        eos_token="<|im_end|>", unk_token="[UNK]",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)


def random_hf_model(name: str):
    """A Qwen3-MoE with a dense layer among sparse ones, or a Qwen3.5 hybrid (with the special ids
    the word-level tokenizer gives: pad 0, bos 1, end of turn 2)."""
    if name != "qwen3.5":
        return random_moe_model(name)
    hf = random_hybrid_model(name)
    for config in (hf.config, hf.generation_config):
        config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 2
    return hf


@pytest.fixture(scope="module", params=["qwen3-moe-norm", "qwen3.5"])
def family(request, tmp_path_factory):
    """(directory, transformers model, tokenizer) of the family."""
    from transformers import AutoTokenizer

    directory, hf = SavedHFModels(random_hf_model, tmp_path_factory)[request.param]
    save_word_tokenizer(directory, hf.config.vocab_size)
    return directory, hf, AutoTokenizer.from_pretrained(directory, local_files_only=True)


@pytest.fixture(scope="module")
def server(family, tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("store"), "--model", family[0])
    yield server
    assert server.stop() == 0, "".join(server.lines)[-3000:]


def transformers_answer(hf, tokenizer, ids: list[int]) -> str:
    """transformers' greedy answer after `ids`, up to ANSWER_TOKENS or its end-of-turn token."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=ANSWER_TOKENS, do_sample=False,
                          eos_token_id=hf.config.eos_token_id, pad_token_id=0)
    return tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def chat(server, messages, document=None) -> str:
    model = server.client.models.list().data[0].id
    extra = {} if document is None else {"document": document}
    response = server.client.chat.completions.create(model=model, messages=messages, max_tokens=ANSWER_TOKENS,
                                                     temperature=0, extra_body=extra)
    return response.choices[0].message.content


def test_questions_on_a_served_document_answer_as_transformers(server, family):
    """The document opens the first user turn (the template's frame around it), each question
    follows it in that turn: the prompt transformers gets is the template over document + question."""
    _, hf, tokenizer = family
    doc = server.wait_ready(server.ingest(DOCUMENT, name="vault")["id"])
    assert doc["status"] == "ready", doc

    def expected(question: str) -> str:
        text = tokenizer.apply_chat_template([{"role": "user", "content": DOCUMENT + " " + question}],
                                             tokenize=False, add_generation_prompt=True)
        return transformers_answer(hf, tokenizer, tokenizer(text, add_special_tokens=False)["input_ids"])

    wanted = {q: expected(q) for q in QUESTIONS}
    assert chat(server, [{"role": "user", "content": " " + QUESTIONS[0]}], doc["id"]) == wanted[QUESTIONS[0]]
    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:  # clients at once: one batch
        answers = list(pool.map(lambda q: chat(server, [{"role": "user", "content": " " + q}], doc["id"]),
                                QUESTIONS))
    assert answers == [wanted[q] for q in QUESTIONS]


def test_a_chat_without_a_document_answers_as_transformers(server, family):
    _, hf, tokenizer = family
    messages = [{"role": "user", "content": "who knows the secret code"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert chat(server, messages) == transformers_answer(hf, tokenizer, ids)
