"""How a request's share of a step is computed (docs/costs.md, "A request's share of a step"), and
the bounds promised there: requests with the same work in the same step are billed the same to the
last bit; a request's bill is its work times a rate between the lowest and the highest seconds per
unit of work of the steps it ran in; so two requests of the same shape, anywhere, are billed apart
by at most the spread of their steps' rates."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqinfer.workers.queue.costs import Meter, WorkModel
from tests.workers.test_costs import MODEL, Work


def chunks(prompt: int, chunk: int, output: int) -> list[tuple[int, int, bool]]:
    """A request's steps: (tokens, context length, prefill) for its prompt in chunks, then decodes."""
    steps, done = [], 0
    while done < prompt:
        n = min(chunk, prompt - done)
        done += n
        steps.append((n, done, True))
    steps += [(1, prompt + k + 1, False) for k in range(output - 1)]
    return steps


def run_beside_others(meter: Meter, rid: str, shape: list[tuple[int, int, bool]], rng: random.Random,
                      start: float) -> list[float]:
    """Bill ``rid``'s steps, each beside 0-5 other random requests and of a random length; returns
    each step's seconds per unit of work."""
    now, rates = start, []
    for s, (n, context, prefill) in enumerate(shape):
        work = [Work(rid, n, context, is_prefill=prefill)]
        for j in range(rng.randrange(6)):
            m = rng.choice([1, 1, 1, rng.randrange(2, 200)])
            work.append(Work(f"{rid}-other-{s}-{j}", m, m + rng.randrange(0, 400), is_prefill=m > 1))
        rng.shuffle(work)
        span = rng.uniform(0.001, 0.2)
        now += span
        meter.step(now, work, {})
        rates.append(span / sum(MODEL.work(w.num_tokens, w.context_len, w.sampled) for w in work))
    return rates


@settings(max_examples=60, deadline=None)
@given(prompt=st.integers(1, 300), chunk=st.integers(8, 256), output=st.integers(1, 40),
       seed=st.integers(0, 2**32 - 1), share=st.sampled_from([0.25, 0.5, 1.0]))
def test_a_bill_is_its_work_at_a_rate_within_its_steps_rates(prompt, chunk, output, seed, share):
    rng = random.Random(seed)
    shape = chunks(prompt, chunk, output)
    work = sum(MODEL.work(n, context, True) for n, context, _ in shape)
    bills, ranges = [], []
    for worker in range(2):  # the same request on two workers, beside different requests
        meter = Meter(MODEL, start=0.0, device_share=share)
        rates = run_beside_others(meter, f"req{worker}", shape, rng, start=0.0)
        bill = meter.pop(f"req{worker}").device_s
        rate = bill / (share * work)
        assert min(rates) * (1 - 1e-9) <= rate <= max(rates) * (1 + 1e-9)
        bills.append(bill)
        ranges.append((min(rates), max(rates)))
    # Hence two requests of the same shape are billed apart by at most their steps' spread of rates.
    low, high = min(r[0] for r in ranges), max(r[1] for r in ranges)
    assert bills[0] / bills[1] <= high / low * (1 + 1e-9)


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 128), st.integers(0, 600)), min_size=1, max_size=6),
       copies=st.integers(2, 4), span=st.floats(1e-4, 5.0), seed=st.integers(0, 1000))
def test_the_same_work_in_the_same_step_is_billed_the_same_to_the_last_bit(shapes, copies, span, seed):
    work = [Work(f"s{i}-c{c}", n, n + before, is_prefill=n > 1)
            for i, (n, before) in enumerate(shapes) for c in range(copies)]
    random.Random(seed).shuffle(work)  # the order of a step's requests changes nothing
    meter = Meter(MODEL, start=0.0, device_share=0.5)
    meter.step(span, work, {})
    bills = {w.request_id: meter.pop(w.request_id).device_s for w in work}
    for i in range(len(shapes)):
        assert len({bills[f"s{i}-c{c}"] for c in range(copies)}) == 1
    assert sum(bills.values()) == pytest.approx(0.5 * span, rel=1e-12)


def test_a_request_pays_for_its_work_not_for_its_tokens():
    """A decode at a long context does more attention work than one at a short context, so it pays
    more of the step; an equal split by request or by token would bill them the same."""
    model = WorkModel(linear_flops_per_token=1000.0, attn_flops_per_pair=10.0, lm_head_flops=500.0)
    meter = Meter(model, start=0.0)
    meter.step(1.0, [Work("short", 1, 10), Work("long", 1, 1000)], {})
    short, long = meter.pop("short").decode_s, meter.pop("long").decode_s
    assert short + long == pytest.approx(1.0)
    assert long / short == pytest.approx((1000 + 10_000 + 500) / (1000 + 100 + 500))
