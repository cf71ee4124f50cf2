"""The continuously batched generator behind the Triton model (harp_trt/serving.py), on
real tiny ORT engines: admission by a KV budget (a HARP engine admits L/(L-P) times the dense one's
sequences, the rest queue and all complete, a request larger than the budget is refused at once),
chunked prefill interleaved with the others' decode steps, and every answer equal to
``OrtCausalLM.generate``'s greedy tokens, alone or batched."""
from __future__ import annotations

import numpy as np
import pytest

from _exported import engine
from harp_trt.errors import ConfigError
from harp_trt.memory import kv_budget_bytes
from harp_trt.ort_session import PREFILL_CHUNK, OrtCausalLM
from harp_trt.serving import BatchedGenerator, GenerationRequest, SamplingParams

MAX_TOKENS = 6


def _prompts(lm: OrtCausalLM, lengths: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, int(lm.vocab_size), n) for n in lengths]


class _Client:
    """One request's tokens, in the order the generator emitted them (``log`` is shared)."""

    def __init__(self, name: str, log: list):
        self.name, self.log, self.tokens, self.reason = name, log, [], None

    def emit(self, ids, finished, reason):
        self.tokens += list(ids)
        self.log.append((self.name, len(ids)))
        if finished:
            self.reason = reason


def _run(gen: BatchedGenerator, prompts, max_tokens=MAX_TOKENS) -> tuple[list[_Client], list]:
    log: list = []
    clients = [_Client(f"r{i}", log) for i in range(len(prompts))]
    for c, p in zip(clients, prompts):
        gen.submit(GenerationRequest(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), c.emit))
    for _ in range(10_000):
        if not gen.step():
            break
    return clients, log


def _greedy(lm: OrtCausalLM, prompt: np.ndarray, n: int = MAX_TOKENS) -> list[int]:
    return lm.generate(prompt[None], max_new_tokens=n)[0, prompt.size:].tolist()


@pytest.fixture(scope="module")
def harp_lm():
    return OrtCausalLM(engine("llama", harp=True), intra_op_threads=2)


def test_kv_budget_admits_by_memory_and_the_rest_queue(harp_lm):
    """A budget for exactly two sequences at their longest: never more than two admitted, the
    other three wait (none refused), every answer is generate's."""
    prompts = _prompts(harp_lm, (9, 9, 9, 9, 9))
    per_seq = (9 + MAX_TOKENS) * harp_lm.kv_bytes_per_token()
    gen = BatchedGenerator(harp_lm, max_active=None, kv_budget=2 * per_seq + per_seq // 2)
    assert gen.admits(9 + MAX_TOKENS) == 2
    clients, _ = _run(gen, prompts)
    assert gen.max_admitted_seen == 2 and gen.max_batch_seen == 2
    assert [c.reason for c in clients] == ["length"] * 5
    assert gen.kv_reserved == 0 and not gen.active and gen.waiting == 0
    for c, p in zip(clients, prompts):
        assert c.tokens == _greedy(harp_lm, p)


def test_harp_admits_l_over_l_minus_p_more_than_dense(harp_lm):
    """Same budget, same lengths: the HARP engine (no KV in its pruned layers) admits
    L/(L-P) times the dense engine's sequences."""
    dense = OrtCausalLM(engine("llama"), intra_op_threads=2)
    L, kept = len(dense.kv_layers), len(harp_lm.kv_layers)
    assert kept < L
    tokens, budget = 64, 12 * 64 * dense.kv_bytes_per_token()
    n_dense = BatchedGenerator(dense, max_active=None, kv_budget=budget).admits(tokens)
    n_harp = BatchedGenerator(harp_lm, max_active=None, kv_budget=budget).admits(tokens)
    assert n_dense == 12 and n_harp == 12 * L // kept
    assert BatchedGenerator(harp_lm, max_active=5, kv_budget=budget).admits(tokens) == 5


def test_a_request_over_the_whole_budget_is_refused_at_once(harp_lm):
    gen = BatchedGenerator(harp_lm, max_active=None, kv_budget=10 * harp_lm.kv_bytes_per_token())
    with pytest.raises(ConfigError, match="more than the whole KV budget"):
        gen.submit(GenerationRequest(np.arange(3, 12), SamplingParams(max_tokens=5), lambda *a: None))
    assert gen.waiting == 0
    with pytest.raises(ConfigError, match="kv_budget"):
        BatchedGenerator(harp_lm, kv_budget=0)


def test_a_long_prefill_does_not_stall_the_others_decode(harp_lm):
    """A long prompt arriving while another request decodes is prefilled one chunk per step, and
    the other request gets a token between its chunks; both answers are generate's."""
    harp_lm.prefill_chunk = 4
    try:
        short, long_ = _prompts(harp_lm, (5, 30), seed=1)
        gen = BatchedGenerator(harp_lm, max_active=None)
        log: list = []
        a, b = _Client("a", log), _Client("b", log)
        gen.submit(GenerationRequest(short, SamplingParams(max_tokens=12, ignore_eos=True), a.emit))
        while len(a.tokens) < 2:                       # a: prefilled (chunks of 4 and 1), then decoding
            gen.step()
        gen.submit(GenerationRequest(long_, SamplingParams(max_tokens=4, ignore_eos=True), b.emit))
        while gen.step():
            pass
        first_b = next(i for i, (who, _) in enumerate(log) if who == "b")
        a_before_b = sum(1 for who, _ in log[:first_b] if who == "a")
        assert a_before_b >= 2 + 30 // 4, log          # a got a token beside each of b's 8 prefill chunks
        assert a.tokens == _greedy(harp_lm, short, 12) and b.tokens == _greedy(harp_lm, long_, 4)
    finally:
        harp_lm.prefill_chunk = PREFILL_CHUNK


def test_kv_budget_forms():
    assert kv_budget_bytes("2GiB") == 2 << 30 and kv_budget_bytes("1024") == 1024
    assert kv_budget_bytes("0.25", available=lambda: 400) == 100 == kv_budget_bytes("25%", available=lambda: 400)
    for bad, match in (("0", "share"), ("150%", "share"), ("lots", "size"), ("0MiB", "positive")):
        with pytest.raises(ConfigError, match=match):
            kv_budget_bytes(bad, available=lambda: 400)


@pytest.mark.parametrize("attention", ["gqa", "onnx"])
def test_rows_joining_and_leaving_keep_every_answer(attention, monkeypatch):
    """Prompts of mixed lengths and budgets through three slots: on the GQA engine the in-place rows
    (``BatchKV``) shift right when a longer prompt joins, move rows when one leaves, trim the shared
    padding (TRIM lowered to 4) and grow; on the opset-23 Attention engine each request keeps its own
    past. Every answer is generate's."""
    from harp_trt.decoding import BatchKV

    monkeypatch.setattr(BatchKV, "TRIM", 4)
    lm = OrtCausalLM(engine("llama", harp=True, attention=attention), intra_op_threads=2)
    assert (lm.shares_kv_buffer, ) == (attention == "gqa", )
    lengths, budgets = (5, 30, 12, 3, 17, 8), (9, 3, 14, 6, 2, 11)
    prompts = _prompts(lm, lengths, seed=2)
    gen = BatchedGenerator(lm, max_active=3)
    assert (gen.kv is not None) == (attention == "gqa")
    log: list = []
    clients = [_Client(f"r{i}", log) for i in range(len(prompts))]
    for c, p, n in zip(clients, prompts, budgets):
        gen.submit(GenerationRequest(p, SamplingParams(max_tokens=n, ignore_eos=True), c.emit))
    while gen.step():
        pass
    assert gen.max_batch_seen == 3
    for c, p, n in zip(clients, prompts, budgets):
        assert c.tokens == _greedy(lm, p, n), c.name
    if gen.kv is not None:
        assert gen.kv.rows == 0 and not gen.rows


def test_in_place_kv_never_holds_more_than_the_budget(harp_lm):
    """Mixed lengths under a budget of three rows at the longest: the batch is admitted by its padded
    footprint (rows x longest), and the in-place buffers never hold more than the budget at any step;
    without the bound the buffers' doubling held more (slots and capacity each rounded up to a power of
    two). Every answer is generate's."""
    from harp_trt.decoding import BatchKV

    lengths, budgets = (5, 30, 12, 3, 17, 8), (9, 3, 14, 6, 2, 11)
    per = harp_lm.kv_bytes_per_token()
    budget = 3 * max(n + m for n, m in zip(lengths, budgets)) * per
    prompts = _prompts(harp_lm, lengths, seed=3)
    seen = {}
    for bounded in (True, False):
        gen = BatchedGenerator(harp_lm, max_active=None, kv_budget=budget)
        assert gen.kv is not None and gen.kv.max_bytes == budget
        if not bounded:
            gen.kv = BatchKV(harp_lm)
        clients = [_Client(f"r{i}", []) for i in range(len(prompts))]
        for c, p, n in zip(clients, prompts, budgets):
            gen.submit(GenerationRequest(p, SamplingParams(max_tokens=n, ignore_eos=True), c.emit))
        most = 0
        while gen.step():
            if gen.active:   # admitted by the padded footprint
                assert len(gen.active) * max(r.tokens_at_most for r in gen.active) * per <= budget
            most = max(most, gen.kv.allocated_bytes)
        seen[bounded] = most
        for c, p, n in zip(clients, prompts, budgets):
            assert c.tokens == _greedy(harp_lm, p, n), c.name
    assert seen[True] <= budget < seen[False], (seen, budget)
