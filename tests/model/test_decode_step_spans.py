"""The fused batch decode step (csrc/cpu_decode.c) on layers that are not plain: sliding windows
(shorter and longer than the cache), aligned chunks (boundaries inside the cache), soft-capped
scores, sink logits, their own softmax scale, partial rotary, NoPE and their own rope_theta, mixed
in one tiny model; against the PyTorch batch path layer by layer (each source's rows through
`KVCache.attend_rows` by position, merged by LSE, `LayerSoftmax.finish`: runtime/batch.py's attend)
and a float64 run of it, for B = 1..4 rows at different positions over documents and own rows,
model-dtype and 8-bit caches, slices whose positions are not 0..n-1, caches that dropped rows a
span layer no longer sees (`KVCache.kept_from`), on every CPU kernel variant this machine runs.
Greedy tokens of a whole generation equal those of the layer path.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ringctx.attention import PartialAccumulator
from ringctx.model import KVCache
from ringctx.model.config import LayerAttention
from ringctx.model.decode_step import AttentionSource, DecodeStep, FusedBatchStep, FusedStep, step_logits
from ringctx.model.kvcache import copy_rows, forward_with_cache
from tests.helpers import rel_err
from tests.kernels.test_cpu_kernels import needs_kernels
from tests.model.test_decode_step import TINY, random_model, threads  # noqa: F401

pytestmark = pytest.mark.usefixtures("kernel_variant")  # once per CPU kernel variant here

MIXED = (
    LayerAttention(window=9, softcap=3.0, rope_theta=500.0),      # window shorter than every cache
    LayerAttention(rope=False, sinks=True),                       # global NoPE layer with sinks
    LayerAttention(chunk=16, rotary_dim=8),                       # chunks cut the caches; partial rotary
    LayerAttention(window=4096, scale=0.3, sinks=True),           # a window longer than the caches
    LayerAttention(),                                             # plain
    LayerAttention(chunk=32, softcap=2.0, sinks=True, rope_theta=50.0, rotary_dim=4),
)
"""Six layers, each something the fused step must apply as data."""

CONFIGS = {
    "d16": dataclasses.replace(TINY, n_layers=6, layer_attention=MIXED),
    # head_dim 64 (the kernels' register tiles), group 3
    "d64": dataclasses.replace(TINY, dim=128, n_layers=6, n_heads=6, n_kv_heads=2, head_dim=64, qkv_bias=True,
                               layer_attention=tuple(dataclasses.replace(a, rotary_dim=a.rotary_dim * 4)
                                                     for a in MIXED)),
}
STEPS = 3  # later steps attend to the rows earlier ones wrote (and cross a chunk boundary or two)


def span_model(name, dtype, seed=0):
    model = random_model(CONFIGS[name], dtype, seed)
    with torch.no_grad():  # sinks of either sign and size (zeros would test nothing)
        for i, block in enumerate(model.layers):
            if block.attention.sinks is not None:
                block.attention.sinks.copy_(torch.linspace(-2.0, 3.0, block.attention.n_heads) + i)
    return model


def tokens_of(n, seed):
    return torch.randint(3, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def prefill(model, tokens, room):
    cache = KVCache.for_model(model.config, len(tokens) + room, dtype=model.dtype)
    with torch.inference_mode():
        forward_with_cache(model, tokens, cache, logits="none")
    return cache


def slice_of(cache, rows, positions, room, kv_dtype="model", dtype=None):
    """A sliced cache holding `rows` of `cache` (a list of row indices) at global `positions`, room
    rows free after them; 8-bit rows quantized as KVCache.update writes them."""
    dtype = dtype or cache.dtype
    out = KVCache(cache.n_layers, len(rows) + room, cache.n_kv_heads, cache.head_dim, dtype=dtype, kv_dtype=kv_dtype,
                  sliced=True)
    index = torch.tensor(rows, dtype=torch.long)
    for layer in range(cache.n_layers):
        out.update(layer, 0, cache.k[layer][index].to(dtype), cache.v[layer][index].to(dtype))
    out.positions[:len(rows)] = torch.tensor(positions, dtype=torch.long)
    out.length = len(rows)
    return out


@dataclasses.dataclass
class Batch:
    """Rows over documents (sliced caches, never written) and own rows (sliced caches after them):
    document_of[i] the row's document (or None), own[i] its own cache, positions[i] its next position."""

    documents: list[KVCache]
    document_of: list[int | None]
    own: list[KVCache]
    positions: list[int]

    def copy(self, dtype=None):
        """The same rows in new caches (float ones in `dtype` if given)."""

        def again(c):
            out = KVCache(c.n_layers, c.max_tokens, c.n_kv_heads, c.head_dim, dtype=dtype or c.dtype,
                          kv_dtype=c.kv_dtype, sliced=True)
            for dst, src in zip(out.storage_tensors(), c.storage_tensors()):
                dst.copy_(src)
            out.positions.copy_(c.positions)
            out.length = c.length
            return out

        return Batch([again(c) for c in self.documents], list(self.document_of), [again(c) for c in self.own],
                     list(self.positions))

    def sources(self):
        documents = []
        for index, document in enumerate(self.documents):
            members = [i for i, d in enumerate(self.document_of) if d == index]
            if members and document.length:
                documents.append(AttentionSource(document, members, document.length))
        own = [AttentionSource(c, [i], c.length + 1, c.length) for i, c in enumerate(self.own)]
        return documents, own

    def before_step(self):
        for c, p in zip(self.own, self.positions):  # the written row's position first: span layers read it
            c.positions[c.length] = p

    def advance(self):
        for c in self.own:
            c.length += 1
        self.positions = [p + 1 for p in self.positions]


def make_batch(model, batch, kv_dtype="model", gaps=False):
    """Rows 0, 2, ... on document 0 (its rows at positions 0..39; with gaps, this rank holding
    only 0..14 and 25..39), rows 1, 3, ... on none; each row's own rows after its document, of a
    different length per row (so every row at its own position)."""
    doc_tokens = tokens_of(40, seed=5)
    kept_doc = list(range(15)) + list(range(25, 40)) if gaps else list(range(40))
    documents, document_of, own, positions = [], [], [], []
    for i in range(batch):
        on_document = i % 2 == 0
        own_tokens = tokens_of(3 + 11 * i, seed=10 + i)
        tokens = torch.cat([doc_tokens, own_tokens]) if on_document else own_tokens
        whole = prefill(model, tokens, room=0)
        first = 40 if on_document else 0
        if on_document and not documents:
            documents.append(slice_of(whole, kept_doc, kept_doc, 0, kv_dtype))
        document_of.append(0 if on_document else None)
        rows = list(range(first, len(tokens)))
        own.append(slice_of(whole, rows, rows, STEPS + 1, kv_dtype))
        positions.append(len(tokens))
    return Batch(documents, document_of, own, positions)


def layer_path(model, setup, tokens, merge=lambda out, lse: (out, lse)):
    """One step of the PyTorch batch path (runtime/batch.py's attend): float32 logits [B, vocab]."""
    setup.before_step()

    def attend(layer, q, k, v):
        B, H, D = q.shape
        softmax = model.layer_softmax(layer)
        out = torch.zeros(B, H, D, dtype=torch.float32)
        lse = torch.full((H, B), float("-inf"), dtype=torch.float32)
        acc = PartialAccumulator.over(out, lse)
        for document, members, keys in ((s.cache, s.rows, s.keys) for s in setup.sources()[0]):
            o, l = document.attend_rows(layer, q[members], keys, softmax=softmax,
                                        q_positions=[setup.positions[i] for i in members])
            for j, i in enumerate(members):
                acc.add(o[j:j + 1].float(), l[:, j:j + 1], i)
        for i, c in enumerate(setup.own):
            c.update(layer, c.length, k[i:i + 1], v[i:i + 1])
            o, l = c.attend_rows(layer, q[i:i + 1], c.length + 1, softmax=softmax, q_positions=[setup.positions[i]])
            acc.add(o.float(), l, i)
        return softmax.finish(*merge(acc.out, acc.lse)).to(q.dtype)

    with torch.inference_mode():
        x = model.embed(torch.tensor(tokens))
        at = torch.tensor(setup.positions)
        rope = model.rope(at, sequence_end=at + 1)
        for index, block in enumerate(model.layers):
            x = block.forward(x, rope, attend, index)
        logits = model.head(model.norm(x))
    setup.advance()
    return logits


def fused_path(step, setup, tokens, merge=None):
    setup.before_step()
    with torch.inference_mode():
        documents, own = setup.sources()
        logits = step_logits(step.model, step(tokens, setup.positions, documents, own, merge))
    setup.advance()
    return logits


def half_merge(out, lse):
    """Another rank's partial equal to this one's (the exchange is runtime/batch.py's), returned with
    the merged lse (a model with sinks needs it)."""
    acc = PartialAccumulator(out.shape[0], out.shape[1], out.shape[2])
    acc.add(out.clone(), lse.clone())
    acc.add(out.clone(), lse.clone())
    return acc.out, acc.lse


@needs_kernels
def test_the_model_is_what_the_tests_say():
    """The mixed layers reach the kernel as data, and the caches' chunk boundaries and windows fall
    inside the rows attended (else the tests below would test plain layers)."""
    model = span_model("d16", torch.float32)
    step = FusedBatchStep.build(model)
    assert step is not None
    layers = step.layers
    assert [layers[i].window for i in range(6)] == [9, 0, 0, 4096, 0, 0]
    assert [layers[i].chunk for i in range(6)] == [0, 0, 16, 0, 0, 32]
    assert [layers[i].rotary_dim for i in range(6)] == [16, 16, 8, 16, 16, 4]
    assert layers[1].rope == -1 and len({layers[i].rope for i in (0, 2, 3, 5)}) == 4
    assert [bool(layers[i].sinks) for i in range(6)] == [False, True, False, True, False, True]
    assert abs(layers[3].scale - 0.3) < 1e-7 and layers[0].softcap == 3.0


@needs_kernels
@pytest.mark.parametrize("batch", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["d16", "d64"])
def test_float32_spans_equal_the_layer_path_and_float64(name, batch, threads):  # noqa: F811
    model, exact_model = span_model(name, torch.float32), span_model(name, torch.float64)
    step = FusedBatchStep.build(model)
    for gaps, merge in ((False, None), (True, half_merge)):
        fused = make_batch(model, batch, gaps=gaps)
        plain, exact = fused.copy(), fused.copy(dtype=torch.float64)
        tokens = [(7 * i + 3) % model.config.vocab_size for i in range(batch)]
        for _ in range(STEPS):
            got = fused_path(step, fused, tokens, merge)
            want = layer_path(model, plain, tokens, merge or (lambda out, lse: (out, lse)))
            truth = layer_path(exact_model, exact, tokens, merge or (lambda out, lse: (out, lse)))
            for i in range(batch):
                assert rel_err(got[i], want[i]) < 1e-5, (i, gaps, rel_err(got[i], want[i]))
                assert rel_err(got[i], truth[i]) < 1e-4, (i, gaps, rel_err(got[i], truth[i]))
            assert got.argmax(dim=-1).tolist() == want.argmax(dim=-1).tolist()  # the same greedy tokens
            tokens = [int(t) for t in want.argmax(dim=-1)]
        for a, b in zip(fused.own, plain.own):  # the K/V rows the kernel wrote
            for x, y in zip(a.k + a.v, b.k + b.v):
                torch.testing.assert_close(x[:a.length], y[:b.length], atol=2e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_8bit_span_caches_equal_the_layer_path(kv_dtype, threads):  # noqa: F811
    """Each step from the same 8-bit state, to 1e-3: the logits those of the layer path, the rows
    it writes PyTorch's quantizer's (scales to 1e-3, codes at most one step apart). Why not 1e-5: a
    code one step away (where a K/V value differs in its last bits) in the row a query writes and
    reads in the same step, under a window of 9 rows, moves that layer's output, so the later
    layers' rows and the logits, by up to ~3e-4; each next step starts from the kernel's rows on
    both paths, so that this does not compound."""
    model = span_model("d64", torch.float32)
    step = FusedBatchStep.build(model)
    fused = make_batch(model, 4, kv_dtype, gaps=True)
    tokens = [3, 9, 27, 81]
    for _ in range(STEPS):
        plain = fused.copy()
        got, want = fused_path(step, fused, tokens), layer_path(model, plain, tokens)
        for i in range(4):
            assert rel_err(got[i], want[i]) < 1e-3, (i, rel_err(got[i], want[i]))
        for a, b in zip(fused.own, plain.own):
            row = a.length - 1
            for x, y in zip(a.k + a.v, b.k + b.v):  # codes (fp8: bytes of one sign) at most one step apart
                step_apart = (x[row].view(torch.int8).int() - y[row].view(torch.int8).int()).abs()
                assert int(step_apart.max()) <= 1
            for x, y in zip(a.k_scale + a.v_scale, b.k_scale + b.v_scale):
                torch.testing.assert_close(x[row], y[row], atol=0, rtol=1e-3)
        tokens = [int(t) for t in want.argmax(dim=-1)]


@needs_kernels
def test_bf16_spans_are_as_accurate_as_the_layer_path(threads):  # noqa: F811
    """Against a float32 computation from the same state (the same bf16 weights and cache rows)."""
    model = span_model("d64", torch.bfloat16)
    exact_model = span_model("d64", torch.bfloat16).float()
    step = FusedBatchStep.build(model)
    state = make_batch(model, 4, gaps=True)
    tokens = [3, 9, 27, 81]
    fused = fused_path(step, state.copy(), tokens)
    plain = layer_path(model, state.copy(), tokens)
    exact = layer_path(exact_model, state.copy(dtype=torch.float32), tokens)
    for i in range(4):
        plain_err, fused_err = rel_err(plain[i], exact[i]), rel_err(fused[i], exact[i])
        assert plain_err > 0
        assert fused_err <= 2 * plain_err, (i, fused_err, plain_err)


def dropped(cache, keep_from):
    """A copy of a dense cache whose layers l dropped their rows below keep_from[l] (row i of the
    layer then in slot i - keep_from[l] of a shorter buffer, as KVCache.kept_from describes)."""
    out = KVCache(cache.n_layers, cache.max_tokens, cache.n_kv_heads, cache.head_dim, dtype=cache.dtype,
                  kept=keep_from)
    copy_rows(out, 0, cache, 0, cache.length)
    out.length = cache.length
    return out


@needs_kernels
def test_a_cache_that_dropped_rows_is_read_through_kept_from(threads):  # noqa: F811
    """A lone generation whose windowed and chunked layers dropped the rows they no longer see gives
    the bits of the same cache whole; a step that would need a dropped row is refused clearly."""
    model = span_model("d16", torch.float32)
    whole = prefill(model, tokens_of(70, seed=3), room=STEPS + 1)
    # at position 70: window 9 sees 62.., chunk 16 sees 64.., chunk 32 sees 64..
    for shared in (0, 50):
        a, b = dropped(whole, [0] * 6), dropped(whole, [62, 0, 64, 0, 0, 64])
        fa, fb = FusedStep.build(model, a, shared_rows=shared), FusedStep.build(model, b, shared_rows=shared)
        token = 5
        with torch.inference_mode():
            for _ in range(STEPS):  # positions 70, 71, 72: none needs a row below what is kept
                want, got = fa(token), fb(token)
                assert torch.equal(got, want)
                token = int(want.argmax())
    for keep_from in ([63, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0]):  # the window at 70 sees row 62; a full layer all
        step = FusedStep.build(model, dropped(whole, keep_from))
        with pytest.raises(ValueError, match="no longer stores"), torch.inference_mode():
            step(5)


@needs_kernels
@pytest.mark.parametrize("name", ["d16", "d64"])
def test_greedy_generation_equals_the_layer_path(name):
    """A lone sequence decoded step by step (DecodeStep: fused, and forward_with_cache) over a
    prompt that crosses windows and chunk boundaries: the same greedy tokens, logits to 1e-5."""
    model = span_model(name, torch.float32)
    prompt = tokens_of(45, seed=9)
    fused_cache, plain_cache = prefill(model, prompt, room=24), prefill(model, prompt, room=24)
    fused, plain = DecodeStep(model, fused_cache), DecodeStep(model, plain_cache, fused=False)
    assert fused.is_fused and not plain.is_fused
    token, picked = 7, []
    with torch.inference_mode():
        for _ in range(20):
            got, want = fused(token), plain(token)
            assert rel_err(got, want) < 1e-5
            assert int(got.argmax()) == int(want.argmax())
            token = int(want.argmax())
            picked.append(token)
    assert len(set(picked)) > 1  # the model does not emit one token forever


@needs_kernels
def test_a_lone_step_is_its_row_of_a_batch_bit_for_bit():
    """A lone sequence over one cache (its document's rows, then its own) and the same sequence as a
    row of a batch over a document cache and an own cache: the same bits in span layers too."""
    model = span_model("d64", torch.bfloat16)
    step = FusedBatchStep.build(model)
    setup = make_batch(model, 3)
    document, own = setup.documents[0], setup.own[0]
    whole = KVCache.for_model(model.config, 40 + own.length + STEPS + 1, dtype=model.dtype)
    for layer in range(model.config.n_layers):
        whole.k[layer][:40].copy_(document.k[layer][:40])
        whole.v[layer][:40].copy_(document.v[layer][:40])
        whole.k[layer][40:40 + own.length].copy_(own.k[layer][:own.length])
        whole.v[layer][40:40 + own.length].copy_(own.v[layer][:own.length])
    whole.length = 40 + own.length
    lone = FusedStep.build(model, whole, shared_rows=40)
    tokens = [11, 12, 13]
    for _ in range(STEPS):
        together = fused_path(step, setup, tokens)
        with torch.inference_mode():
            alone = lone(tokens[0])
        assert torch.equal(alone[0], together[0])
        tokens = [int(t) for t in together.argmax(dim=-1)]


@needs_kernels
def test_sinks_over_ranks_need_the_merged_lse():
    model = span_model("d16", torch.float32)
    step = FusedBatchStep.build(model)
    setup = make_batch(model, 2)
    with pytest.raises(ValueError, match="sink logits"):
        fused_path(step, setup, [1, 2], lambda out, lse: half_merge(out, lse)[0])


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["model", "int8"])
def test_rows_in_arrival_order_equal_the_layer_path(kv_dtype, threads):  # noqa: F811
    """A slice whose rows are not in position order (a ring prefill writes a document piece by piece,
    in zigzag order): each run of increasing positions is searched alone, and every row attends what
    the layer path's attend_rows gives it."""
    model = span_model("d16", torch.float32)
    step = FusedBatchStep.build(model)
    fused = make_batch(model, 3, kv_dtype)
    order = [list(range(20, 30)) + list(range(0, 10)) + list(range(30, 40)) + list(range(10, 20))]
    document = fused.documents[0]
    shuffled = KVCache(document.n_layers, document.max_tokens, document.n_kv_heads, document.head_dim,
                       dtype=document.dtype, kv_dtype=kv_dtype, sliced=True)
    index = torch.tensor(order[0])
    for dst, src in zip(shuffled.storage_tensors(), document.storage_tensors()):
        dst[:40].copy_(src[index])
    shuffled.positions[:40] = document.positions[index]
    shuffled.length = 40
    fused.documents[0] = shuffled
    own = fused.own[1]  # an own slice whose rows arrive in two pieces (positions 3..8 after 9..13)
    n = own.length
    index = torch.cat([torch.arange(n // 2, n), torch.arange(0, n // 2)])
    for t in own.storage_tensors():
        t[:n] = t[:n][index].clone()
    own.positions[:n] = own.positions[:n][index].clone()
    plain = fused.copy()
    tokens = [4, 8, 15]
    for _ in range(STEPS):
        got, want = fused_path(step, fused, tokens), layer_path(model, plain, tokens)
        for i in range(3):
            assert rel_err(got[i], want[i]) < (1e-5 if kv_dtype == "model" else 1e-3), (i, rel_err(got[i], want[i]))
        tokens = [int(t) for t in want.argmax(dim=-1)]
