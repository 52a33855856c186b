"""What a finished request becomes in the worker (``workers/queue/worker.py``): its result and cost rows,
one per choice, queued for the sinks and the ack (``workers/queue/acks.py``), its lane's charge settled from
its ``max_tokens`` to the tokens it generated, its metrics, and its prefix published when KV tiers
hold it; and the ``duplicate`` cost row of work no result row of this worker will carry.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from mqinfer.scheduler.fair import OUTPUT_TOKEN_WEIGHT
from mqinfer.workers.queue.acks import Acks
from mqinfer.workers.queue.billing import Billing, finished_fields
from mqinfer.workers.queue.costs import Meter, RequestMeter
from mqinfer.workers.engine.outputs import choice_id
from mqinfer.workers.queue.kv_prefixes import TierPrefixes
from mqinfer.workers.queue.lanes import LaneSet, lane_of
from mqinfer.workers.queue.ownership import Ownership
from mqinfer.workers.queue.slo import missed_targets


class Finishing:
    """The worker's finished requests, from the engine's output to the rows in the acks' buffer."""

    def __init__(self, *, ownership: Ownership, meter: Meter, billing: Billing, acks: Acks, metrics,
                 lanes: LaneSet, clock: Callable[[], float], tier_prefixes: TierPrefixes | None = None) -> None:
        self.ownership = ownership
        self.meter = meter
        self.billing = billing
        self.acks = acks
        self.metrics = metrics
        self.lanes = lanes
        self.clock = clock
        self.tier_prefixes = tier_prefixes

    def finish(self, out) -> None:
        """Queue the rows of a finished choice; once its request's last choice finished, all of them."""
        item = self.ownership.get(out.request_id)
        n = item.num_choices
        if n > 1:
            # Each choice's meter is complete once it finished; the rows wait for the last choice.
            item.choices[out.index] = (out, self.meter.pop(choice_id(item.entry_id, out.index)))
            if len(item.choices) < n:
                return
            finished = [item.choices[i] for i in range(n)]
        else:
            finished = [(out, self.meter.pop(item.entry_id))]
        item, ours = self.ownership.release(out.request_id)
        if not ours:  # another worker owns the entry now: its row wins
            self.bill_wasted(item, merged(meter for _, meter in finished))
            return
        now = self.clock()
        rows, costs, log_lines = [], [], []
        for choice, meter in finished:
            row, cost = self.billing.request(item, choice, meter, now)
            fields = finished_fields(item, choice, row, cost, meter)
            rows.append(row)
            costs.append(cost)
            if row.slo_met is not None:
                self.metrics.slo_outcome(row.tenant, missed_targets(self.billing.targets.of(item.request), row))
            log_lines.append(("finished %s", (json.dumps(fields),), fields))
        self.acks.add_choices(item.entry_id, rows, costs, reply_to=item.request.reply_to, computed=True,
                              log_lines=log_lines)
        if self.tier_prefixes is not None:
            self.tier_prefixes.add(item.request)
        # The lane was charged the request's max_tokens when it was read: correct it.
        output_tokens = sum(len(choice.output_token_ids) for choice, _ in finished)
        self.lanes.settle(lane_of(item.entry_id),
                                 OUTPUT_TOKEN_WEIGHT * (output_tokens - item.request.max_tokens))
        self.metrics.prompt_tokens.inc(out.num_prompt_tokens)
        self.metrics.e2e.observe(max(0.0, now - item.enqueued_at))
        self.metrics.charge(item.request.tenant, sum(cost.cost_usd for cost in costs))

    def pop_meter(self, item) -> RequestMeter:
        """The device time of every choice of an entry's request, finished or not (for a row this
        worker will not write)."""
        meters = []
        for i in range(item.num_choices):
            done = item.choices.get(i)
            meters.append(done[1] if done is not None else self.meter.pop(choice_id(item.entry_id, i)))
        return merged(meters)

    def bill_wasted(self, item, meter) -> None:
        """A ``duplicate`` cost row for work no result row of this worker will carry."""
        cost = self.billing.wasted(item, meter)
        if cost is not None:
            self.acks.add_cost(cost)


def merged(meters) -> RequestMeter:
    """One meter holding the device time of several (a request's choices)."""
    meters = list(meters)
    if len(meters) == 1:
        return meters[0]
    total = RequestMeter()
    for m in meters:
        total.prefill_s += m.prefill_s
        total.decode_s += m.decode_s
        total.recomputed_s += m.recomputed_s
        total.kv_block_s += m.kv_block_s
    return total


__all__ = ["Finishing", "merged"]
