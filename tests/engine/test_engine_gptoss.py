"""The engine on gpt-oss (tests/model/test_model_gptoss.py's tiny model: sliding 8 / full layers with
sinks, YaRN, biases, the biased top-k-then-softmax router and clamped-SwiGLU experts) against
transformers: prefills at W = 1 and 3 with pass-KV and pass-Q forced (the sinks enter once, in the
ring's last merge); a document split over two decode ranks answered greedily alone and batched;
tensor parallelism 2 (every expert's width and its gate/up biases split, the down bias added by
rank 0); and a harmony-shaped chat template (the tokenizer's own) placing the document and the
question where the template says, through ingest / ask."""

import pytest
import torch

from ringctx.engine import Engine
from tests.helpers import (assert_engine_prefills_match, assert_tp2_prefill_and_answer_equal_transformers,
                           assert_two_documents_answer_as_transformers, hf_greedy, random_hf_model_of, random_prompt)
from tests.model.test_model_gptoss import hf_config

HARMONY = ("<|start|>system<|message|>Reasoning: low<|end|>"
           "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
           "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
"""A chat template in the shape of gpt-oss's harmony format (its real one adds a longer system
message and channels): a system turn, each message as <|start|>role<|message|>content<|end|>, then
the assistant's header."""


def harmony_tokenizer():
    """A byte-level tokenizer (ids 0-255 the bytes) with harmony's special tokens (256-259) and the
    HARMONY chat template, built with the tokenizers library (no hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=HARMONY, eos_token="<|return|>",
                                   additional_special_tokens=["<|start|>", "<|message|>", "<|end|>"])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(directory, transformers model): the tiny gpt-oss (vocabulary 264: the tokenizer's 260 ids)
    saved with its harmony tokenizer."""
    directory = tmp_path_factory.mktemp("gpt-oss")
    config = hf_config()
    config.vocab_size = 264
    hf = random_hf_model_of(config)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    hf.save_pretrained(directory)
    harmony_tokenizer().save_pretrained(directory)
    return str(directory), hf


def test_prefill_and_chat_template_on_one_rank(saved):
    """W = 1: prefills equal transformers'; a text document and question are rendered by the
    tokenizer's template (system turn, the document opening the user turn, the question after a
    blank line, then the assistant's header) and answered as transformers answers those ids."""
    directory, hf = saved
    document, question = "The cat sat on the mat.", "Where did the cat sit?"
    with Engine(directory, nproc=1, dtype="float32") as engine:
        assert_engine_prefills_match(engine, hf, ((5, 64), (97, 37)), "W1")
        tokenizer = engine.model.tokenizer
        doc = engine.ingest(document)
        answer = engine.generate(doc, question, max_new_tokens=8, stop_token_ids=[])
        "".join(answer)
    expected = tokenizer.apply_chat_template([{"role": "user", "content": f"{document}\n\n{question}"}],
                                             tokenize=False, add_generation_prompt=True)
    assert expected == (f"<|start|>system<|message|>Reasoning: low<|end|><|start|>user<|message|>{document}\n\n"
                        f"{question}<|end|><|start|>assistant")
    ids = doc.token_ids.tolist() + engine.question_ids(doc, question).tolist()
    assert tokenizer.decode(ids) == expected and ids[0] == tokenizer.convert_tokens_to_ids("<|start|>")
    assert answer.result.token_ids == hf_greedy(hf, ids)


def test_prefill_and_answers_on_three_ranks_and_two_decode_ranks(saved):
    """W = 3 (short prompts leave ranks without tokens), pass-KV and pass-Q; a 130-token document
    split over two decode ranks, answered alone and batched, and a second document beside it."""
    directory, hf = saved
    doc_a, doc_b = random_prompt(130, seed=3).tolist(), random_prompt(70, seed=4).tolist()
    questions = [[7, 11, 13], [5, 9], [21, 22, 23, 24, 25, 26, 27, 28, 29]]
    with Engine(directory, nproc=3, dtype="float32", decode_ranks=2, chunk_tokens=32) as engine:
        assert_engine_prefills_match(engine, hf, ((5, 64), (97, 37)), "W3")
        assert_two_documents_answer_as_transformers(engine, hf, doc_a, doc_b, questions)


def test_tensor_parallel_prefill_and_answer_match_transformers(saved):
    """TP 2: each rank holds half of every expert's units (and of their gate/up biases) and of the
    heads (and their sinks); rank 0 adds the down biases before the all-reduce."""
    directory, hf = saved
    assert_tp2_prefill_and_answer_equal_transformers(directory, hf)
