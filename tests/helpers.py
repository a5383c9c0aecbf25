"""Helpers shared by the model test modules."""

import torch


def one_thread_for_module():
    """One intra-op thread: on a shared, busy 2-core machine, OpenMP threads that wait for each other
    make small ops many times slower; the results do not depend on it. (Wrapped as a module-scoped
    autouse fixture by each model test module.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in float64."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def band_mask(T: int, S: int, causal: bool = True, q_offset: int = 0, window: int = 0) -> torch.Tensor:
    """[T, S] bool: query row i sees key row j iff j <= i + q_offset and (window == 0 or
    j > i + q_offset - window) when causal, every key otherwise (the CPU flash kernels' mask)."""
    from ringctx.attention.reference import band_mask as causal_band

    return causal_band(T, S, q_offset, window) if causal else torch.ones(T, S, dtype=torch.bool)


def capped_attention(q, k, v, visible, scale: float, softcap: float = 0.0, dtype=torch.float64):
    """reference_attention's math in `dtype` with logit soft-capping (softcap > 0: each score
    s = scale q.k becomes softcap tanh(s / softcap) before the mask and the softmax, as transformers'
    Gemma 2 computes it): (out [T, Hq, D], lse [Hq, T]), zeros and -inf for rows that see no key.
    In float64 it is the reference; in float32 (on the same inputs) PyTorch's own float32 computation,
    the yardstick of the float32 rule."""
    group = q.shape[1] // k.shape[1]
    qh = q.to(dtype).transpose(0, 1)
    kh = k.to(dtype).transpose(0, 1).repeat_interleave(group, dim=0)
    vh = v.to(dtype).transpose(0, 1).repeat_interleave(group, dim=0)
    scores = torch.einsum("htd,hsd->hts", qh, kh) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(finite, lse, torch.zeros_like(lse)).unsqueeze(-1))
    probs = torch.where(finite.unsqueeze(-1), probs, torch.zeros_like(probs))
    return torch.einsum("hts,hsd->htd", probs, vh).transpose(0, 1), lse


# -- a family against transformers: the same random weights saved once, read by both ---------------

def saved_hf_pair(name: str, make_hf, tmp_path_factory):
    """(name, ringctx model, transformers model, directory): make_hf(name)'s weights saved as
    safetensors and read back by ringctx's loader in float32."""
    from ringctx.model import load_model

    directory = tmp_path_factory.mktemp(name)
    hf = make_hf(name)
    hf.save_pretrained(directory)
    return name, load_model(str(directory), dtype=torch.float32, device="cpu"), hf, directory


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    """transformers' float32 logits [T, vocab] of one sequence of ids [T]."""
    with torch.no_grad():
        return hf(input_ids=ids[None]).logits[0].float()


def assert_logits_match(pair, prompts, measured: dict | None = None, tol: float = 1e-4) -> None:
    """Every prompt's logits within `tol` (relative) of transformers'; the largest error per case
    kept in `measured` (a module's report)."""
    name, ours, hf, _ = pair
    for ids in prompts:
        err = rel_err(ours.logits(ids), hf_logits(hf, ids))
        if measured is not None:
            measured[name] = max(measured.get(name, 0.0), err)
        assert err < tol, (name, ids.numel(), err)


def assert_gguf_logits_match(name: str, from_gguf, from_hf, hf, lengths, measured: dict, tol: float = 1e-4,
                              tol_directory: float = 1e-4) -> None:
    """A GGUF load's logits of a prompt of each length (tests.model.test_model_families.prompt)
    within `tol` of transformers' and within `tol_directory` of the same weights read from the
    Hugging Face directory (`from_hf`); the largest error against transformers kept in `measured`."""
    from tests.model.test_model_families import prompt

    for n in lengths:
        ids = prompt(n)
        got = from_gguf.logits(ids)
        err = rel_err(got, hf_logits(hf, ids))
        measured[name] = max(measured.get(name, 0.0), err)
        assert err < tol, (name, n, err)
        assert rel_err(got, from_hf.logits(ids)) < tol_directory, (name, n)


def assert_greedy_matches(pair, ids: torch.Tensor, n: int = 6) -> None:
    """ringctx's greedy decode picks transformers' generate's n tokens after ids."""
    name, ours, hf, _ = pair
    with torch.no_grad():
        ref = hf.generate(input_ids=ids[None], max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, ids.numel():].tolist()
    assert ours.generate(ids, max_new_tokens=n, stop_token_ids=[]).token_ids == ref, name


# -- a family through the Engine against transformers ----------------------------------------------

def random_prompt(n: int, seed: int = 1) -> torch.Tensor:
    """n random token ids [n] (3..255: clear of a tiny vocabulary's special ids)."""
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed))


def hf_greedy(hf, ids: list[int], n: int = 8) -> list[int]:
    """transformers' n greedy tokens after ids (no stop token)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def assert_engine_prefills_match(engine, hf, cases, what="") -> None:
    """Each (tokens, chunk_tokens) case's last logits within 1e-4 of transformers', pass-KV and
    pass-Q forced."""
    for n, chunk in cases:
        ids = random_prompt(n)
        ref = hf_logits(hf, ids)[-1:]
        for strategy in ("pass-kv", "pass-q"):
            result = engine.prefill(ids, chunk_tokens=chunk, strategy=strategy)
            assert rel_err(result.logits, ref) < 1e-4, (what, n, strategy)


def assert_engine_answers_match(engine, hf, document, document_ids: list[int], questions, n: int = 8) -> None:
    """The first question answered alone, then every question batched (ask_many), each with
    transformers' greedy tokens after the document's."""
    alone = engine.generate(document, questions[0], max_new_tokens=n, stop_token_ids=[])
    "".join(alone)
    assert alone.result.token_ids == hf_greedy(hf, document_ids + questions[0], n)
    many = engine.ask_many(document, questions, max_new_tokens=n, stop_token_ids=[])
    for _ in many:
        pass
    for q, result in zip(questions, many.results):
        assert result.token_ids == hf_greedy(hf, document_ids + q, n), q


class SavedHFModels(dict):
    """case -> (directory, transformers model): make_hf(case)'s model saved with save_pretrained on
    first use (a module-scoped fixture's value: each case saved once for every test of a module)."""

    def __init__(self, make_hf, tmp_path_factory):
        super().__init__()
        self.make_hf, self.tmp_path_factory = make_hf, tmp_path_factory

    def __missing__(self, name):
        directory = self.tmp_path_factory.mktemp(name)
        hf = self.make_hf(name)
        hf.save_pretrained(directory)
        self[name] = (str(directory), hf)
        return self[name]


def assert_two_documents_answer_as_transformers(engine, hf, doc_a: list[int], doc_b: list[int], questions):
    """Ingest two documents; questions on the first, alone and batched, and one on the second beside
    it, answer as transformers' greedy generate does. Returns the two Documents."""
    a, b = engine.ingest(doc_a), engine.ingest(doc_b)
    assert_engine_answers_match(engine, hf, a, doc_a, questions)
    other = engine.generate(b, questions[1], max_new_tokens=8, stop_token_ids=[])
    "".join(other)
    assert other.result.token_ids == hf_greedy(hf, doc_b + questions[1])
    return a, b


def random_hf_model_of(config, seed: int = 0):
    """transformers' model of `config` (an image-text one when it has a text_config) in float32, every
    parameter random: norms uniform in 0.5..1.5, the rest normal with std 0.05 (seeded before the
    model is built, so its own init draws count too)."""
    import transformers

    torch.manual_seed(seed)
    auto = transformers.AutoModelForImageTextToText if hasattr(config, "text_config") else \
        transformers.AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in param_name else torch.randn_like(p) * 0.05)
    return model


def assert_tp_shards_are_slices(path, tp_size: int, whole: dict | None = None, what=()) -> None:
    """Each of `tp_size` TP ranks' float32 models loaded from `path` (a directory or GGUF file)
    holds exactly the slices of the whole model's parameters (`whole`: name -> tensor, loaded
    without TP when None) that weights.py's `_full_rows` names; `what` labels a failure."""
    from ringctx.model import load_model
    from ringctx.model.tensor_parallel import TensorParallel
    from ringctx.model.weights import _full_rows, keep_index

    if whole is None:
        whole = dict(load_model(str(path), dtype=torch.float32, device="cpu").named_parameters())
    for rank in range(tp_size):
        shard = load_model(str(path), dtype=torch.float32, device="cpu", tp=TensorParallel(tp_size, rank))
        for name, param in shard.named_parameters():
            _, rows, cols = _full_rows(shard, name, param)
            expected = whole[name][rows] if cols is None else whole[name][rows][keep_index(cols)]
            assert torch.equal(param, expected), (*what, tp_size, rank, name)


def assert_tp2_prefill_and_answer_equal_transformers(directory, hf, what: str = "") -> None:
    """An engine of 2 ranks with TP 2 on the checkpoint in `directory`: a 97-token prefill in chunks
    of 37 within 1e-4 of transformers' last logits, and an answer on it as a document equal to
    transformers' 8 greedy tokens."""
    from ringctx.engine import Engine

    ids = random_prompt(97)
    ref = hf_logits(hf, ids)[-1:]
    with Engine(str(directory), nproc=2, tp=2, dtype="float32") as engine:
        assert rel_err(engine.prefill(ids, chunk_tokens=37).logits, ref) < 1e-4, what
        doc = engine.ingest(ids.tolist())
        answer = engine.generate(doc, [7, 11, 13], max_new_tokens=8, stop_token_ids=[])
        "".join(answer)
        assert answer.result.token_ids == hf_greedy(hf, ids.tolist() + [7, 11, 13]), what
