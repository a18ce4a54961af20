"""The Prometheus series of /metrics, vLLM's set under the minfer_ prefix. Gauges read the engine's state
when scraped; counters and histograms are fed by the engine thread, once a step. One registry per server,
so that several servers (tests) in one process do not collide."""
from __future__ import annotations

import bisect
import time

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

# seconds; TTFT and end-to-end span CPU runs (seconds) to GPU ones (milliseconds)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class Histogram:
    """prometheus_client's Histogram series, fed in bulk: observe(value, count) is one bisect, where
    prometheus_client's takes a lock and walks the buckets for each of `count` values. One writer (the engine
    thread); a scrape reads plain ints."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry, buckets=LATENCY_BUCKETS):
        self.name, self.documentation, self.bounds = name, documentation, list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum, self.created = 0.0, time.time()
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count  # a bucket holds values <= its bound
        self.sum += value * count

    def collect(self):
        total, buckets = 0, []
        for bound, n in zip(self.bounds + [float("inf")], self.counts):
            total += n
            buckets.append((floatToGoString(bound), total))
        family = HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=self.sum)
        family.add_sample(self.name + "_created", {}, self.created)
        yield family


class Metrics:
    def __init__(self, engine):
        self.registry = r = CollectorRegistry()
        bm = engine.core.block_manager
        Gauge("minfer_num_requests_running", "Requests in the running batch", registry=r).set_function(
            lambda: engine.num_running)
        Gauge("minfer_num_requests_waiting", "Requests waiting to be admitted", registry=r).set_function(
            lambda: engine.num_waiting)
        Gauge("minfer_kv_pages_used", "KV cache pages held by requests", registry=r).set_function(
            lambda: bm.num_pages - bm.num_free_pages)
        Gauge("minfer_kv_pages_free", "KV cache pages free (prefix-cached ones included)", registry=r).set_function(
            lambda: bm.num_free_pages)
        Gauge("minfer_kv_pages_total", "KV cache pages", registry=r).set_function(lambda: bm.num_pages)
        Gauge("minfer_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens looked up",
              registry=r).set_function(lambda: bm.hit_rate)
        self.prompt_tokens = Counter("minfer_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("minfer_generation_tokens", "Generated tokens", registry=r)
        self.finished = Counter("minfer_requests_finished", "Finished requests", ["finish_reason"], registry=r)
        self.ttft = Histogram("minfer_time_to_first_token_seconds", "Time to first token", r)
        self.itl = Histogram("minfer_inter_token_latency_seconds", "Time between a request's tokens", r)
        self.e2e = Histogram("minfer_e2e_request_latency_seconds", "Arrival to last token", r)
