"""The fused batch decode step (ringctx_decode_step_batch via FusedBatchStep) against the PyTorch
batch path it replaces (`Block.forward` layer by layer, attending each document's rows for its
queries and each sequence's own rows, merged by LSE), against a float64 run of that path, and
against each sequence's lone fused step, for B = 1..9 sequences at different positions over 0-3
shared documents (model-dtype, int8 and fp8 caches), on every CPU kernel variant this machine runs.

float32: every row's logits within 1e-5 relative of the PyTorch path, 1e-4 of float64, and equal
bit for bit to the lone step's (a lone step is this kernel with one row; in bf16 and 8-bit caches
too). bf16: rounded at the same places as the PyTorch path, so its error against a float32
computation from the same state is at most twice the PyTorch bf16 path's (the rule of
tests/model/test_decode_step.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ringctx.attention import PartialAccumulator
from ringctx.model import KVCache
from ringctx.model.decode_step import AttentionSource, FusedBatchStep, FusedStep, step_logits
from tests.kernels.test_cpu_kernels import needs_kernels
from tests.helpers import rel_err
from tests.model.test_decode_step import (  # noqa: F401
    SHAPES,
    TINY,
    copy_of,
    prefilled,
    quantized_copy,
    random_model,
    threads,
)

pytestmark = pytest.mark.usefixtures("kernel_variant")  # once per CPU kernel variant here

STEPS = 2  # the second step attends to the rows the first one wrote


def sequences(model, count, kv_dtype="model", first=17):
    """`count` caches of different lengths (so different positions), each with room to grow."""
    caches = [prefilled(model, first + 23 * i, room=STEPS + 1, seed=i + 1) for i in range(count)]
    return caches if kv_dtype == "model" else [quantized_copy(c, kv_dtype) for c in caches]


def copy_any(cache, dtype=None):
    """A copy of a cache of any storage (8-bit rows stay 8-bit); dtype: a float copy's dtype."""
    if not cache.quantized:
        return copy_of(cache, dtype)
    other = KVCache(cache.n_layers, cache.max_tokens, cache.n_kv_heads, cache.head_dim, dtype=dtype or cache.dtype,
                    kv_dtype=cache.kv_dtype)
    for dst, src in zip(other.storage_tensors(), cache.storage_tensors()):
        dst.copy_(src)
    other.length = cache.length
    return other


@dataclasses.dataclass
class Setup:
    """A batch: documents (caches never written), each row's document (index or None) and own cache
    (None: the row has no own rows on this rank), and whether this rank writes each row's token."""

    documents: list[KVCache]
    document_of: list[int | None]
    own: list[KVCache | None]
    writes: list[bool]

    def copy(self, dtype=None):
        return Setup([copy_any(d, dtype) for d in self.documents], list(self.document_of),
                     [None if c is None else copy_any(c, dtype) for c in self.own], list(self.writes))

    def positions(self):
        return [(self.documents[d].length if d is not None else 0) + (c.length if c is not None else 0)
                for d, c in zip(self.document_of, self.own)]

    def sources(self):
        documents = []
        for index, document in enumerate(self.documents):
            members = [i for i, d in enumerate(self.document_of) if d == index]
            if members and document.length:
                documents.append(AttentionSource(document, members, document.length))
        own = [AttentionSource(c, [i], c.length + int(w), c.length if w else None)
               for i, (c, w) in enumerate(zip(self.own, self.writes)) if c is not None and c.length + int(w)]
        return documents, own

    def advance(self):
        for c, w in zip(self.own, self.writes):
            if c is not None and w:
                c.length += 1


def attend_over(setup, merge):
    """The PyTorch batch path's attend: each document's rows for its rows' queries, each row's own
    rows (its k, v written first), merged by LSE, then `merge` (another rank's part, say)."""

    def attend(layer, q, k, v):
        B, H, D = q.shape
        out = torch.zeros(B, H, D, dtype=torch.float32)
        lse = torch.full((H, B), float("-inf"), dtype=torch.float32)
        acc = PartialAccumulator.over(out, lse)
        for document, members, keys in ((s.cache, s.rows, s.keys) for s in setup.sources()[0]):
            o, l = document.attend_rows(layer, q[members], keys)
            for j, i in enumerate(members):
                acc.add(o[j:j + 1].float(), l[:, j:j + 1], i)
        for i, (c, w) in enumerate(zip(setup.own, setup.writes)):
            if c is None:
                continue
            if w:
                c.update(layer, c.length, k[i:i + 1], v[i:i + 1])
            if c.length + int(w):
                o, l = c.attend_rows(layer, q[i:i + 1], c.length + int(w))
                acc.add(o.float(), l, i)
        return merge(acc.out, acc.lse).to(q.dtype)

    return attend


def pytorch_batch(model, setup, tokens, merge=lambda out, lse: out):
    """One step of the PyTorch batch path: float32 logits [B, vocab] (float64 for a float64 model)."""
    with torch.inference_mode():
        x = model.embed(torch.tensor(tokens))
        rope = model.rope(torch.tensor(setup.positions()))
        attend = attend_over(setup, merge)
        for index, block in enumerate(model.layers):
            x = block.forward(x, rope, attend, index)
        logits = model.head(model.norm(x))
    setup.advance()
    return logits


def fused_batch(step, setup, tokens, merge=None):
    """One step of the fused batch path: float32 logits [B, vocab]."""
    with torch.inference_mode():
        documents, own = setup.sources()
        x = step(tokens, setup.positions(), documents, own, merge)
        logits = step_logits(step.model, x)
    setup.advance()
    return logits


def own_only(model, batch, kv_dtype="model"):
    return Setup([], [None] * batch, sequences(model, batch, kv_dtype), [True] * batch)


def with_documents(model, batch, n_documents, kv_dtype="model", long_own=False):
    """Rows over n_documents shared documents (of 0, 1 or several rows each, some empty), a row
    with none, rows this rank does not write, a row with no own rows here, and with long_own a
    row whose own rows are long enough to be split over the threads."""
    documents = sequences(model, n_documents, kv_dtype, first=40) if n_documents else []
    if n_documents > 2:
        documents[2].length = 0  # this rank holds none of the third document's rows
    document_of = [None if n_documents == 0 or i % (n_documents + 1) == n_documents else i % (n_documents + 1)
                   for i in range(batch)]
    own = sequences(model, batch, kv_dtype, first=3)
    writes = [i % 3 != 1 for i in range(batch)]
    if batch > 3:
        own[3] = None  # every row of this sequence lies on other ranks (the merge brings them)
    if long_own:
        own[0] = sequences(model, 1, kv_dtype, first=1100)[0]
    return Setup(documents, document_of, own, writes)


@needs_kernels
@pytest.mark.parametrize("batch", range(1, 10))
@pytest.mark.parametrize("shape", ["gqa2-d16", "gqa3-d64-bias-tied", "gqa3-d48-odd-ffn", "qwen3-qknorm-yarn"])
def test_float32_batch_equals_pytorch_batch_and_lone_steps(shape, batch, threads):  # noqa: F811
    model = random_model(SHAPES[shape], torch.float32)
    step = FusedBatchStep.build(model)
    assert step is not None
    fused = own_only(model, batch)
    plain = fused.copy()
    lone = [FusedStep.build(model, copy_of(c)) for c in fused.own]
    tokens = [(7 * i + 3) % model.config.vocab_size for i in range(batch)]
    for _ in range(STEPS):
        got = fused_batch(step, fused, tokens)
        want = pytorch_batch(model, plain, tokens)
        assert got.shape == want.shape == (batch, model.config.vocab_size)
        for i in range(batch):
            alone = lone[i](tokens[i])[0]
            assert rel_err(got[i], want[i]) < 1e-5, (i, rel_err(got[i], want[i]))
            assert torch.equal(got[i], alone), (i, rel_err(got[i], alone))  # a lone step is a row of one
        tokens = [int(t) for t in want.argmax(dim=-1)]
    for a, b in zip(fused.own, plain.own):  # the K/V rows the kernel wrote
        for x, y in zip(a.k + a.v, b.k + b.v):
            torch.testing.assert_close(x[:a.length], y[:b.length], atol=2e-5, rtol=1e-5)


def half_merge(out, lse):
    """A stand-in for another rank: its partial is this one's again (the merged output is this
    rank's own; the exchange and rank order are runtime/batch.py's, tested there)."""
    acc = PartialAccumulator(out.shape[0], out.shape[1], out.shape[2])
    acc.add(out.clone(), lse.clone())
    acc.add(out.clone(), lse.clone())
    return acc.out


@needs_kernels
@pytest.mark.parametrize("n_documents", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 4, 9])
@pytest.mark.parametrize("shape", ["gqa2-d16", "gqa3-d64-bias-tied", "gqa4-d128"])
def test_shared_documents_equal_the_pytorch_path_and_float64(shape, batch, n_documents, threads):  # noqa: F811
    """Documents read once for all their rows, own rows after, with and without a merge callback:
    float32 within 1e-5 of the PyTorch path, 1e-4 of float64."""
    model = random_model(SHAPES[shape], torch.float32)
    exact_model = random_model(SHAPES[shape], torch.float64)
    step = FusedBatchStep.build(model)
    for merge in (None, half_merge):
        fused = with_documents(model, batch, n_documents, long_own=batch == 9)
        plain, exact = fused.copy(), fused.copy(torch.float64)
        tokens = [(5 * i + 2) % model.config.vocab_size for i in range(batch)]
        for _ in range(STEPS):
            got = fused_batch(step, fused, tokens, merge)
            want = pytorch_batch(model, plain, tokens, merge or (lambda out, lse: out))
            truth = pytorch_batch(exact_model, exact, tokens, merge or (lambda out, lse: out))
            for i in range(batch):
                assert rel_err(got[i], want[i]) < 1e-5, (i, rel_err(got[i], want[i]))
                assert rel_err(got[i], truth[i]) < 1e-4, (i, rel_err(got[i], truth[i]))
            tokens = [int(t) for t in want.argmax(dim=-1)]


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("shape", ["gqa2-d16", "gqa3-d64-bias-tied", "gqa4-d128"])
def test_8bit_documents_and_own_rows_equal_the_pytorch_path(shape, kv_dtype, threads):  # noqa: F811
    """8-bit caches: the rows the kernel quantizes are those PyTorch's quantizer writes (to one
    code where a float32 value differs in its last bit), the logits those of the PyTorch path."""
    model = random_model(SHAPES[shape], torch.float32)
    step = FusedBatchStep.build(model)
    fused = with_documents(model, 6, 2, kv_dtype, long_own=True)
    plain = fused.copy()
    tokens = [(3 * i + 1) % model.config.vocab_size for i in range(6)]
    for _ in range(STEPS):
        got = fused_batch(step, fused, tokens)
        want = pytorch_batch(model, plain, tokens)
        for i in range(6):
            assert rel_err(got[i], want[i]) < 1e-4, (i, rel_err(got[i], want[i]))
        tokens = [int(t) for t in want.argmax(dim=-1)]


@needs_kernels
def test_more_queries_than_one_pass_takes():
    """Group 8, 9 rows on one document: 72 query rows per KV head, over the kernel's 64, so the
    document is read in two passes; every row as in the PyTorch path."""
    config = dataclasses.replace(TINY, dim=128, n_heads=8, n_kv_heads=1, head_dim=32)
    model = random_model(config, torch.float32)
    step = FusedBatchStep.build(model)
    fused = with_documents(model, 9, 1)
    fused.document_of = [0] * 9
    plain = fused.copy()
    tokens = list(range(9))
    got, want = fused_batch(step, fused, tokens), pytorch_batch(model, plain, tokens)
    for i in range(9):
        assert rel_err(got[i], want[i]) < 1e-5


@needs_kernels
def test_a_row_does_not_depend_on_the_rest_of_the_batch():
    """A sequence's logits are the same bits alone and among eight others on its document."""
    model = random_model(SHAPES["gqa3-d64-bias-tied"], torch.bfloat16)
    step = FusedBatchStep.build(model)
    crowd = with_documents(model, 9, 1, long_own=True)
    crowd.document_of = [0] * 9
    alone = Setup(crowd.documents, [0], [copy_any(crowd.own[0])], [True])
    together = fused_batch(step, crowd, list(range(9)))
    assert torch.equal(fused_batch(step, alone, [0])[0], together[0])


def document_then_own(document, own, room):
    """One cache of `document`'s rows followed by `own`'s (the same storage), `room` rows free."""
    D, O = document.length, own.length
    whole = KVCache(document.n_layers, D + O + room, document.n_kv_heads, document.head_dim, dtype=document.dtype,
                    kv_dtype=document.kv_dtype)
    for dst, first, then in zip(whole.storage_tensors(), document.storage_tensors(), own.storage_tensors()):
        dst[:D].copy_(first[:D])
        dst[D:D + O].copy_(then[:O])
    whole.length = D + O
    return whole


@needs_kernels
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("kv_dtype", ["model", "int8", "fp8"])
def test_a_lone_step_is_its_row_of_a_batch_bit_for_bit(kv_dtype, split, threads):  # noqa: F811
    """A lone sequence's step (FusedStep over one cache: the rows it held before the answer began
    are its document, the rest its own rows) gives, bit for bit, the logits of its row in a batch
    with others, whose document and own rows are caches of their own (bf16; `split`: a rank of
    several, the partials merged by a callback)."""
    model = random_model(SHAPES["gqa3-d64-bias-tied"], torch.bfloat16)
    batch = FusedBatchStep.build(model)
    setup = with_documents(model, 5, 2, kv_dtype, long_own=True)  # row 1 reads document 1, written elsewhere
    for row in (0, 1):
        crowd = setup.copy()
        document, own = crowd.documents[crowd.document_of[row]], crowd.own[row]
        whole = document_then_own(document, own, room=STEPS + 1)
        lone = FusedStep.build(model, whole, shared_rows=document.length)
        tokens = [(5 * i + 2) % model.config.vocab_size for i in range(5)]
        for _ in range(STEPS):
            together = fused_batch(batch, crowd, tokens, half_merge if split else None)
            with torch.inference_mode():
                if split or not crowd.writes[row]:
                    keys = whole.length + int(crowd.writes[row])
                    alone = lone.split(tokens[row], document.length + own.length - int(crowd.writes[row]),
                                       whole.length if crowd.writes[row] else None, keys,
                                       half_merge if split else None)
                    whole.length = keys
                else:
                    alone = lone(tokens[row])
            assert torch.equal(alone[0], together[row]), (row, rel_err(alone[0], together[row]))
            tokens = [int(t) for t in together.argmax(dim=-1)]
    with pytest.raises(ValueError, match="within the cache's"):
        FusedStep.build(model, whole, shared_rows=whole.length + 1)


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["model", "int8", "fp8"])
@pytest.mark.parametrize("shape", ["gqa2-d16", "gqa3-d64-bias-tied", "qwen3-qknorm-yarn"])
def test_bf16_batch_is_as_accurate_as_the_pytorch_batch(shape, kv_dtype, threads):  # noqa: F811
    """Against a float32 computation from the same state (the same bf16 weights and cache rows)."""
    model = random_model(SHAPES[shape], torch.bfloat16)
    exact_model = random_model(SHAPES[shape], torch.bfloat16).float()  # the same bf16 weights, in float32
    step = FusedBatchStep.build(model)
    assert step is not None
    state = with_documents(model, 5, 2, kv_dtype)
    tokens = [3, 9, 27, 81, 243]
    fused = fused_batch(step, state.copy(), tokens)
    plain = pytorch_batch(model, state.copy(), tokens)
    exact = pytorch_batch(exact_model, state.copy(torch.float32), tokens)
    for i in range(len(tokens)):
        plain_err, fused_err = rel_err(plain[i], exact[i]), rel_err(fused[i], exact[i])
        assert plain_err > 0  # bf16 rounding happened: the rule below is not vacuous
        assert fused_err <= 2 * plain_err, (i, fused_err, plain_err)


@needs_kernels
def test_an_error_in_merge_is_raised_and_bad_batches_are_refused():
    model = random_model(SHAPES["gqa2-d16"], torch.float32)
    step = FusedBatchStep.build(model)
    setup = own_only(model, 2)
    documents, own = setup.sources()

    def broken(out, lse):
        raise ConnectionError("rank lost")

    with pytest.raises(ConnectionError, match="rank lost"):
        step([1, 2], [5, 6], documents, own, broken)
    with pytest.raises(ValueError, match="1 tokens, 2 positions"):
        step([1], [5, 6], documents, own)
    with pytest.raises(ValueError, match="1..64"):
        step([1] * 65, [5] * 65, documents, own)
    with pytest.raises(ValueError, match="vocabulary"):
        step([model.config.vocab_size, 1], [5, 6], documents, own)
    with pytest.raises(ValueError, match="inside the batch of 1"):
        step([1], [5], documents, own)  # own[1] names row 1 of a batch of one
    with pytest.raises(ValueError, match="each once"):  # a document row named twice
        step([1, 2], [5, 6], [AttentionSource(setup.own[0], [0, 0], 3)], own)
    with pytest.raises(ValueError, match="write row"):  # a row past the cache's room
        step([1], [5], [], [AttentionSource(setup.own[0], [0], 3, setup.own[0].max_tokens)])
    with pytest.raises(ValueError, match="twice"):  # two own caches for one row
        step([1, 2], [5, 6], [], [AttentionSource(setup.own[0], [0], 3), AttentionSource(setup.own[1], [0], 3)])
    with pytest.raises(RuntimeError, match="refuses"):  # two rows on one own source
        step([1, 2], [5, 6], [], [AttentionSource(setup.own[0], [0, 1], 3)])
    wide = KVCache.for_model(model.config, 8, dtype=torch.float64)
    assert not step.takes(wide)
    with pytest.raises(ValueError, match="cannot read"):
        step([1], [5], [], [AttentionSource(wide, [0], 1)])


def test_falls_back_where_the_kernel_does_not_apply():
    model = random_model(SHAPES["gqa2-d16"], torch.float16)
    assert FusedBatchStep.build(model) is None

