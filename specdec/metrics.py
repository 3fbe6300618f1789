"""Per-request speculative statistics, with vLLM's meanings.

- drafted tokens: proposals the target scored; accepted tokens: those verification kept,
  counted before a stop string (or max_tokens) cuts the text, as vLLM's scheduler counts them;
  so accepted_tokens may exceed the output tokens a stop string left.
- acceptance_rate = accepted / drafted.
- mean_accepted_length = 1 + accepted / drafts (vLLM's "mean acceptance length": tokens per
  drafting step, the bonus/recovered token included; 1.0 with no drafts), the same figure as
  the server's and the serve benchmark's mean_acceptance_length.
- tokens_per_forward = output tokens per target forward pass (every forward, drafting or not;
  after any stop-string cut): what plain decoding's 1.0 is compared with.
- per_position_acceptance[i] = P(draft position i accepted | position i was drafted), position i
  being the (i+1)-th token of the accepted path. A chain drafts positions 0..k-1; a token tree
  (EAGLE topk > 1, Medusa) of any number of nodes drafts the positions of its depths: position i
  when it offered at least one node at depth i + 1 (record_step's `depth`). draft_tokens counts a
  tree's nodes, so for trees the per-position drafted counts do not sum to it.

RequestStats also carries vLLM v1's RequestStateStats (vllm/v1/metrics/stats.py), as
RequestOutput.metrics: arrival_time (the wall clock, time.time(), when the engine took the request),
queued_ts, scheduled_ts (first scheduled: a preemption does not move it), first_token_ts,
last_token_ts (the engine's monotonic clock, time.perf_counter, as vLLM's engine-core
timestamps), first_token_latency (= time_to_first_token_s: arrival to first token),
num_generation_tokens (= output_tokens) and is_corrupted.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    target_forward_passes: int = 0
    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    wall_time_s: float = 0.0
    time_to_first_token_s: float = 0.0
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    prefill_time_s: float = 0.0      # the prompt's forward (and the proposer's own prefill)
    queue_time_s: float = 0.0        # arrival to the step that first scheduled it
    cached_tokens: int = 0           # prompt tokens found in the prefix cache (not computed)
    prediction_tokens: int = 0       # Predicted Outputs: the prediction's tokens ...
    accepted_prediction_tokens: int = 0   # ... and those of them verification kept (drafted from it)
    rejected_prediction_tokens: int = 0   # ... and those not in the output (OpenAI's; set when it finishes)
    # vLLM v1's RequestStateStats: arrival on the wall clock, the rest on the engine's monotonic
    # clock (time.perf_counter); 0.0 until they happen
    arrival_time: float = 0.0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    # vLLM sets it when a request's logits held NaNs (only with VLLM_COMPUTE_NANS_IN_LOGITS);
    # specdec does not count NaNs, so it stays False, as vLLM's does by default
    is_corrupted: bool = False
    # the server's stats lines (server/metrics.StatLogger): these counts as of its last look at them
    logged: tuple | None = field(default=None, repr=False, compare=False)

    def record_step(self, k: int, num_accepted: int, emitted: int, depth: int | None = None) -> None:
        """One target forward: k draft tokens scored (a chain's, or a tree's nodes), num_accepted of
        them kept (the accepted path's length), emitted tokens output. depth: a tree's depth
        (tree_depth(parents)); None for a chain, whose depth is k. Per position (depth) i:
        drafted when the draft reached depth i + 1, accepted when the path did."""
        self.target_forward_passes += 1
        self.output_tokens += emitted
        if k == 0:
            return
        depth = k if depth is None else depth
        self.num_drafts += 1
        self.draft_tokens += k
        self.accepted_tokens += num_accepted
        if len(self.drafted_per_position) < depth:
            grow = depth - len(self.drafted_per_position)
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(depth):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted

    @property
    def first_token_latency(self) -> float:
        """vLLM's name for time_to_first_token_s."""
        return self.time_to_first_token_s

    @property
    def num_generation_tokens(self) -> int:
        """vLLM's name for output_tokens."""
        return self.output_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """vLLM's mean acceptance length: 1 + accepted / drafts (1.0 when nothing was drafted)."""
        return 1.0 + self.accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def tokens_per_forward(self) -> float:
        """Output tokens per target forward pass (0.0 before the first)."""
        return self.output_tokens / self.target_forward_passes if self.target_forward_passes else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def merge(self, other: "RequestStats") -> None:
        """Add other's counts and times, queue_time_s included. time_to_first_token_s is not added:
        a merge of one request's choices takes its first choice's TTFT and queue time after
        (LLM._output, RequestStream), as the request's own latencies. The timestamps span the
        choices: the earliest arrival, queueing, scheduling and first token, the latest last token."""
        for name in ("prompt_tokens", "output_tokens", "target_forward_passes", "num_drafts", "draft_tokens",
                     "accepted_tokens", "cached_tokens", "wall_time_s", "draft_time_s", "target_time_s", "prefill_time_s",
                     "queue_time_s", "prediction_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("arrival_time", "queued_ts", "scheduled_ts", "first_token_ts"):
            setattr(self, name, min((t for t in (getattr(self, name), getattr(other, name)) if t), default=0.0))
        self.last_token_ts = max(self.last_token_ts, other.last_token_ts)
        self.is_corrupted |= other.is_corrupted
        n = max(len(self.drafted_per_position), len(other.drafted_per_position))
        pad = lambda xs: xs + [0] * (n - len(xs))  # noqa: E731
        self.drafted_per_position = [a + b for a, b in zip(pad(self.drafted_per_position), pad(other.drafted_per_position))]
        self.accepted_per_position = [a + b for a, b in zip(pad(self.accepted_per_position), pad(other.accepted_per_position))]

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "target_forward_passes": self.target_forward_passes,
            "num_drafts": self.num_drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "tokens_per_forward": round(self.tokens_per_forward, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
            "tokens_per_second": round(self.tokens_per_second, 2),
            "wall_time_s": round(self.wall_time_s, 4),
            "time_to_first_token_s": round(self.time_to_first_token_s, 4),
            "prefill_time_s": round(self.prefill_time_s, 4),
            "queue_time_s": round(self.queue_time_s, 4),
            "cached_tokens": self.cached_tokens,
        }


def tree_depth(parents: list[int]) -> int:
    """A token tree's depth: its longest root-to-leaf path (parents[i]: node i's parent, an earlier
    node, or -1 for a child of the root)."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return max(depths, default=0)


def draft_positions(engine) -> int:
    """The draft positions an engine's speculation can fill: its K, or with "auto" the largest
    K the policy may choose (a tree's depth is at most its K); 0 without a proposer."""
    k = engine.num_speculative_tokens
    if k == "auto":
        return min(engine.max_k, engine.caps.max_tree_size or engine.max_k)
    return int(k)


# vLLM's histogram buckets (vllm/v1/metrics/buckets.py, its PrometheusStatLogger's defaults), so
# that rules written against vLLM's `le` bounds read specdec's. Seconds: time to first token ...
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# ... inter-token latency, and a request's time per output token ...
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
# ... a request's e2e, queue, prefill, decode and inference times
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # tokens per step
REQUEST_N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five(limit: int) -> tuple[int, ...]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... up to limit."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass
class Metric:
    """vLLM's metric snapshot (vllm.v1.metrics.reader, LLM.get_metrics()): a name and its labels."""
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Histogram(Metric):
    """count and sum of the observations, and buckets: {upper bound as text: observations at or
    below it} (cumulative, "+Inf" last), as vLLM's reader gives them."""
    count: int
    sum: float
    buckets: dict[str, int]


class HistogramTally:
    """Observations into fixed buckets, for Histogram snapshots. counts[i]: observations in bucket
    i, the last one above every bound; a snapshot copies them at once, so its buckets and count
    agree while another thread observes."""

    def __init__(self, bounds):
        self.bounds, self.counts, self.sum = tuple(bounds), [0] * (len(bounds) + 1), 0.0

    def observe(self, value: float) -> None:
        self.sum += value
        self.counts[bisect_left(self.bounds, value)] += 1

    def snapshot(self, name: str, labels: dict) -> Histogram:
        counts, buckets, total = list(self.counts), {}, 0
        for bound, n in zip(self.bounds, counts):
            total += n
            buckets[str(float(bound))] = total
        buckets["+Inf"] = total = total + counts[-1]
        return Histogram(name, dict(labels), total, self.sum, buckets)

